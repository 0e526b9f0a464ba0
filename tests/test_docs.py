"""The docs: README stays a front door whose links resolve; the site builds with
``mkdocs build --strict`` (a broken link, an unknown anchor or an unresolved reference fails); its
generated pages hold what the code says (every config key, every public module, the tested
versions); and its front page, rendered by headless Chromium, shows the quickstart.

CI sets BASETRAINER_REQUIRE_BROWSER=1 (.ci/run installs Chromium first): then a missing Chromium
or missing docs tools fail these tests instead of skipping them.
"""
import html
import http.server
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from typing import List, Optional

import pytest

from conftest import ROOT

from basetrainer.utils import setup_config

REQUIRED = os.environ.get("BASETRAINER_REQUIRE_BROWSER") == "1"
CHROMIUM_INSTALL = "apt-get update && apt-get install -y chromium"
DOCS_INSTALL = 'pip install -e ".[docs]"'

# DESIGN.md §1: each public module and names it documents (their API pages must render them)
SEED_API = {
    "basetrainer.engine.trainer": ["EngineTrainer", "EngineTrainer.build_dataloader",
                                   "EngineTrainer.build_model_parallel"],
    "basetrainer.engine.launch": ["launch"],
    "basetrainer.criterion.criterion": ["get_criterion"],
    "basetrainer.metric.accuracy_recorder": ["AccuracyRecorder"],
    "basetrainer.callbacks.log_history": ["LogHistory"],
    "basetrainer.callbacks.model_checkpoint": ["ModelCheckpoint"],
    "basetrainer.callbacks.losses_recorder": ["LossesRecorder"],
    "basetrainer.callbacks.multi_losses_recorder": ["MultiLossesRecorder"],
    "basetrainer.scheduler.build_scheduler": ["get_scheduler"],
    "basetrainer.optimizer.build_optimizer": ["get_optimizer"],
    "basetrainer.utils.log": ["set_logger"],
    "basetrainer.utils.file_utils": ["create_dir", "copy_file_to_dir"],
    "basetrainer.utils.setup_config": ["parser_config", "save_config"],
    "basetrainer.utils.torch_tools": ["set_env_random_seed", "load_state_dict"],
    "basetrainer.models.build_models": ["get_models"],
    "basetrainer.pruning.nni_pruning": ["model_pruning"],
}
# DESIGN.md §1b: a page for each that exists in this checkout
EVALUATE_DEPLOY = ["basetrainer.utils.converter.pytorch2onnx", "basetrainer.engine.onnx_engine",
                   "basetrainer.metric.eval_tools", "basetrainer.metric.map_tools",
                   "basetrainer.dataloader.data_resample", "basetrainer.utils.torchcam_utils"]


def _missing(what: str, fix: str) -> None:
    message = f"{what} is not installed: {fix}"
    if REQUIRED:
        pytest.fail(f"{message} (BASETRAINER_REQUIRE_BROWSER=1: CI must run this test, not skip it)")
    pytest.skip(message)


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def quickstart_commands(markdown: str) -> List[str]:
    """The commands of the first ``bash`` block under '## Quickstart' (comments stripped)."""
    section = markdown.split("## Quickstart", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README's Quickstart has no bash block"
    commands = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    return [c for c in commands if c]


def visible_text(page: str) -> str:
    """A page's text, as a reader sees it: no scripts or styles, no tags, single spaces."""
    page = re.sub(r"<(script|style|template)\b.*?</\1>", " ", page, flags=re.S | re.I)
    page = re.sub(r"<[^>]+>", "", page)
    return " ".join(html.unescape(page).split())


# ---------------------------------------------------------------------------------- README
def test_readme_is_a_front_door_whose_links_resolve():
    readme = _readme()
    lines = len(readme.splitlines())
    # 200 lines until README's trainer became a whole script a newcomer can paste and run (67 lines,
    # tests/test_readme.py runs it): the rest of the detail still belongs on a docs page
    assert lines <= 240, f"README.md has {lines} lines; the detail belongs on a docs page"
    links = re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert len(local) >= 15, local      # the docs pages, CHANGELOG.md, LICENSE
    for link in local:
        assert os.path.exists(os.path.join(ROOT, link)), f"README links to {link}, which does not exist"
    assert "mkdocs serve" in readme     # how to build and open the docs locally


def test_ci_runs_the_test_command_the_quickstart_gives():
    commands = quickstart_commands(_readme())
    assert commands == ["./setup.sh && .venv/bin/python examples/example.py",
                        "./setup.sh && .venv/bin/python -m pytest"]
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    assert commands[1] in ci                                   # stated in its header
    assert re.search(r"^\./setup\.sh\b", ci, re.M)             # run as the first command does
    # .venv runs the command with no argument (the floor environment may select); only the slow
    # tests that the floor run takes are left out, through conftest (test_release checks the split)
    assert re.search(r'"\$venv/bin/python" -m pytest "\$@"$', ci, re.M)
    assert re.search(r'^BASETRAINER_FLOOR_RUNS="\$\{FLOOR_FILES\[\*\]\}" suite \.venv$', ci, re.M)
    assert "apt-get install -y" in ci and "chromium" in ci and "BASETRAINER_REQUIRE_BROWSER=1" in ci


# ---------------------------------------------------------------------------------- generated sections
def _generate():
    spec = importlib.util.spec_from_file_location("docs_generate", os.path.join(ROOT, "docs", "generate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_keys_table_in_the_markdown_source_is_the_code_s():
    """docs/configuration.md holds the table itself (a reader of the source, on GitHub, sees every
    key): the rows are setup_config.ENGINE_KEYS's keys and defaults, in order, and the section is
    what docs/generate.py writes (so a key added or changed in the code fails here until it is rerun)."""
    generate = _generate()
    with open(os.path.join(ROOT, "docs", "configuration.md"), encoding="utf-8") as f:
        page = f.read()
    table = generate.section(page, "config-keys")
    rows = re.findall(r"^\| `(\w+)` \| `(.*?)` \| (.*?) \| (.*?) \|$", table, re.M)
    assert [key for key, *_ in rows] == list(setup_config.ENGINE_KEYS)
    for key, default, _, meaning in rows:
        assert json.loads(default) == setup_config.ENGINE_KEYS[key][0], (key, default)
        assert html.escape(setup_config.ENGINE_KEYS[key][2], quote=False).replace("|", "\\|") in meaning, key
    assert generate.stale() == [], "run python docs/generate.py"


def test_generate_check_names_a_stale_section(tmp_path, monkeypatch):
    """``python docs/generate.py --check`` fails, naming the page, when the code has a key the page
    lacks; the rewrite puts it in."""
    generate = _generate()
    for page in ("configuration.md", "install.md"):
        (tmp_path / page).write_text(open(os.path.join(ROOT, "docs", page), encoding="utf-8").read())
    monkeypatch.setattr(generate, "DOCS", str(tmp_path))
    monkeypatch.setitem(setup_config.ENGINE_KEYS, "zz_new_key", (7, "int", "a key added to the code"))
    assert generate.main(["--check"]) == 1
    assert generate.stale() == ["docs/configuration.md: config-keys"]
    assert generate.write() == ["docs/configuration.md: config-keys"]
    assert "| `zz_new_key` | `7` | an integer | a key added to the code |" in (tmp_path / "configuration.md").read_text()
    assert generate.main(["--check"]) == 0


# ---------------------------------------------------------------------------------- the site
@pytest.fixture(scope="module")
def site(tmp_path_factory):
    for module, package in (("mkdocs", "mkdocs"), ("material", "mkdocs-material"),
                            ("mkdocstrings", "mkdocstrings"), ("mkdocstrings_handlers.python", "mkdocstrings-python")):
        try:
            importlib.import_module(module)
        except ImportError:
            _missing(package, DOCS_INSTALL)
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    return out, build


def _page(site_dir, path: str) -> str:
    with open(os.path.join(site_dir, path), encoding="utf-8") as f:
        return f.read()


# the tests below build the whole site (10-15 s) and start a browser: not in the fast subset
@pytest.mark.distributed
@pytest.mark.slow
def test_site_builds_strict(site):
    out, build = site
    assert build.returncode == 0, build.stdout + build.stderr
    assert "WARNING" not in build.stderr, build.stderr
    for page in ("index.html", "install/index.html", "trainer/index.html", "configuration/index.html",
                 "modes/index.html", "large-models/index.html", "checkpoints/index.html",
                 "performance/index.html", "benchmarks/index.html", "figures/index.html",
                 "changelog/index.html", "reference/api/index.html"):
        assert os.path.isfile(os.path.join(out, page)), page
    assert os.path.isfile(os.path.join(out, "benchmarks.png"))
    # the benchmark's own files are not pages of their own: fsdp.md lives inside large-models
    assert not os.path.exists(os.path.join(out, "fsdp")) and not os.path.exists(os.path.join(out, "hooks.py"))


@pytest.mark.distributed
@pytest.mark.slow
def test_config_reference_lists_every_key_with_its_default(site):
    out, build = site
    assert build.returncode == 0, build.stderr
    page = _page(out, "configuration/index.html")
    rows = re.findall(r"<tr>\s*<td><code>(\w+)</code></td>\s*<td><code>(.*?)</code></td>", page, re.S)
    table = {key: html.unescape(default) for key, default in rows}
    assert list(table) == list(setup_config.ENGINE_KEYS)        # every key, in the table's order
    for key, (default, _, meaning) in setup_config.ENGINE_KEYS.items():
        assert json.loads(table[key]) == default, (key, table[key])
        assert html.escape(meaning.split("(")[0].strip(), quote=False) in page, key


@pytest.mark.distributed
@pytest.mark.slow
def test_api_reference_renders_every_public_module(site):
    out, build = site
    assert build.returncode == 0, build.stderr
    for module, names in SEED_API.items():
        path = os.path.join(out, "reference", "api", module, "index.html")
        assert os.path.isfile(path), f"no API page for {module}"
        page = _page(out, path)
        for name in names:      # mkdocstrings gives each documented object its dotted id
            assert f'id="{module}.{name}"' in page, (module, name)
    for module in EVALUATE_DEPLOY:
        base = os.path.join(ROOT, *module.split("."))
        exists = os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py"))
        assert os.path.isfile(os.path.join(out, "reference", "api", module, "index.html")) == exists, module
    index = visible_text(_page(out, "reference/api/index.html"))
    for module in SEED_API:
        assert module in index, module
    # the docstrings' reStructuredText is rendered as Markdown (docs/griffe_rst.py), not shown as written
    pages = [os.path.join(out, "reference", "api", name, "index.html")
             for name in os.listdir(os.path.join(out, "reference", "api")) if name.startswith("basetrainer")]
    assert len(pages) >= len(SEED_API)
    for path in pages + [os.path.join(out, "reference", "api", "index.html")]:
        text = visible_text(_page(out, path))
        assert not re.search(r":(class|func|meth|mod|data|attr|exc):`", text), path
        assert not re.search(r"\bExamples?::", text), path


@pytest.mark.distributed
@pytest.mark.slow
def test_generated_pages_follow_their_sources(site):
    out, build = site
    assert build.returncode == 0, build.stderr
    install = visible_text(_page(out, "install/index.html"))
    with open(os.path.join(ROOT, ".ci", "floor-constraints.txt"), encoding="utf-8") as f:
        pins = [line.split("#", 1)[0].strip() for line in f]
    for pin in filter(None, pins):
        name, version = pin.split("==")
        assert f"{name} {version}" in install, pin
    changelog = visible_text(_page(out, "changelog/index.html"))
    assert "Changed against 1.0.x (upgrade notes)" in changelog and "2.0.0" in changelog
    # the FSDP page holds the guide and the benchmark's tables (docs/fsdp.md), headings one level down
    fsdp = _page(out, "large-models/index.html")
    with open(os.path.join(ROOT, "docs", "fsdp.md"), encoding="utf-8") as f:
        headings = re.findall(r"^(#+) (.+)$", f.read(), re.M)
    assert headings
    for hashes, title in headings:
        level = len(hashes) + 1
        assert re.search(rf"<h{level}[^>]*>{re.escape(html.escape(title, quote=False))}", fsdp), title
    assert "Checkpoint layout" in fsdp


# ---------------------------------------------------------------------------------- the browser
def _chromium() -> Optional[str]:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def served(site):
    """The built site on http://127.0.0.1:<free port>/ for as long as the test runs."""
    out, build = site
    assert build.returncode == 0, build.stderr
    handler = lambda *a, **kw: _Quiet(*a, directory=str(out), **kw)   # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _run_chromium(chromium: str, profile, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1280,1600",
             "--hide-scrollbars"]
    return subprocess.run([chromium, *flags, *args], capture_output=True, text=True, timeout=180)


@pytest.mark.distributed
@pytest.mark.slow
def test_front_page_in_chromium_shows_the_quickstart(served, tmp_path):
    chromium = _chromium()
    if chromium is None:
        _missing("Chromium", CHROMIUM_INSTALL)
    dom = _run_chromium(chromium, tmp_path / "profile", "--dump-dom", served)
    assert dom.returncode == 0, dom.stderr[-3000:]
    text = visible_text(dom.stdout)
    assert "Quickstart" in text
    for command in quickstart_commands(_readme()):     # README's two commands, as the page shows them
        assert command in text, (command, text[:2000])
    shown = re.search(r"final test/Accuracy: [0-9.]+", _readme()).group(0)   # README's quickstart figure
    assert shown in text, (shown, text[:2000])                               # the front page shows the same
    # drawn, not only in the DOM: the screenshot is the window's size and not a blank page
    png = tmp_path / "front.png"
    shot = _run_chromium(chromium, tmp_path / "profile", f"--screenshot={png}", served)
    assert shot.returncode == 0 and png.is_file(), shot.stderr[-3000:]
    from PIL import Image

    with Image.open(png) as image:
        assert image.size == (1280, 1600)
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50, "the front page rendered blank"


# measures the page as drawn and writes the result into the DOM that --dump-dom prints: each code
# block wider than its box (cut off, to be scrolled), and each word of a table's code that the
# browser broke over two lines
_MEASURE = """<script>
window.addEventListener("load", () => {
  const out = {blocks: 0, overflow: [], words: 0, broken: []};
  document.querySelectorAll(".md-content pre > code").forEach((code) => {
    out.blocks += 1;
    if (code.scrollWidth > code.clientWidth + 1) out.overflow.push(code.textContent.slice(0, 100));
  });
  document.querySelectorAll(".md-content table code").forEach((code) => {
    for (const node of code.childNodes) {
      if (node.nodeType !== Node.TEXT_NODE) continue;
      for (const m of node.data.matchAll(/\\S+/g)) {
        const range = document.createRange();
        range.setStart(node, m.index);
        range.setEnd(node, m.index + m[0].length);
        const lines = new Set(Array.from(range.getClientRects(), (r) => Math.round(r.top)));
        out.words += 1;
        if (lines.size > 1) out.broken.push(m[0]);
      }
    }
  });
  const pre = document.createElement("pre");
  pre.id = "basetrainer-measured";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("page", ["index.html", "configuration/index.html"])
def test_code_fits_the_page_at_1280_px(site, served, tmp_path, page):
    """At 1280 px (a laptop's window) no code block hides its end behind a scroll bar, and no
    table breaks a word of code in two ("work_spac e", "CrossEntr opyLoss")."""
    chromium = _chromium()
    if chromium is None:
        _missing("Chromium", CHROMIUM_INSTALL)
    out, _ = site
    source = os.path.join(out, page)
    measured = os.path.join(os.path.dirname(source), "measured.html")   # beside it: the same relative links
    with open(source, encoding="utf-8") as f:
        text = f.read()
    with open(measured, "w", encoding="utf-8") as f:
        f.write(text.replace("</body>", _MEASURE + "</body>"))
    url = served + os.path.relpath(measured, out).replace(os.sep, "/")
    dom = _run_chromium(chromium, tmp_path / "profile", "--virtual-time-budget=10000", "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-3000:]
    found = re.search(r'<pre id="basetrainer-measured">(.*?)</pre>', dom.stdout, re.S)
    assert found, dom.stdout[-2000:]
    result = json.loads(html.unescape(found.group(1)))
    assert result["blocks"] >= 1
    assert result["overflow"] == [], f"{page}: code blocks cut off at 1280 px: {result['overflow']}"
    if page.startswith("configuration"):
        assert result["words"] >= 2 * len(setup_config.ENGINE_KEYS)       # each key and default measured
    assert result["broken"] == [], f"{page}: words of code broken in two: {result['broken']}"
