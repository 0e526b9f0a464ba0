"""mkdocs hooks: the pages generated from the code at every build, so they cannot drift from it.

- The configuration keys table (``configuration.md``, at its ``<!-- config-keys -->`` marker) from
  :data:`basetrainer.utils.setup_config.ENGINE_KEYS`: every key, its default, what it accepts and
  what it means.
- The API reference (``reference/api/*.md``): one page per public module of the seed API and of
  the original's evaluate/deploy half that exists in this checkout, rendered by mkdocstrings from
  the docstrings, and listed under the "API reference" section of the navigation.
- The tested lower bounds (``install.md``, at ``<!-- floor-pins -->``) from .ci/floor-constraints.txt.
- The changelog page (``changelog.md``) from the repository's CHANGELOG.md.
- ``<!-- include: NAME -->`` in a page inserts the docs file NAME (written by a benchmark script,
  e.g. fsdp.md) with its headings one level down, so its measurements live on the page that
  describes the feature.

mkdocs.yml names this file under ``hooks:``; ``mkdocs build --strict`` fails on any warning,
including a broken link, an unknown anchor or a reference mkdocstrings cannot resolve.
"""
import ast
import html
import json
import os
import re
import sys
from typing import Any, Dict, List, Optional, Tuple

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files, InclusionLevel
from mkdocs.structure.nav import Navigation, Section
from mkdocs.structure.pages import Page

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from griffe_rst import roles_to_markdown  # noqa: E402  (docs/griffe_rst.py, beside this file)

# The public modules, grouped as the API reference lists them: DESIGN.md §1 (the seed's API),
# §1b (the original's evaluate and deploy half) and the other modules whose names users import.
# A module that does not exist in this checkout gets no page (its group is left out if empty).
API_GROUPS: List[Tuple[str, List[str]]] = [
    ("Trainer and loop", ["basetrainer", "basetrainer.engine.trainer", "basetrainer.engine.engine",
                          "basetrainer.engine.checkpointer", "basetrainer.engine.inference",
                          "basetrainer.engine.launch",
                          "basetrainer.engine.history"]),
    ("Callbacks", ["basetrainer.callbacks.callbacks", "basetrainer.callbacks.log_history",
                   "basetrainer.callbacks.model_checkpoint", "basetrainer.callbacks.recorder",
                   "basetrainer.callbacks.losses_recorder",
                   "basetrainer.callbacks.multi_losses_recorder", "basetrainer.callbacks.early_stopping",
                   "basetrainer.callbacks.model_ema", "basetrainer.callbacks.progress_bar",
                   "basetrainer.callbacks.mlflow_logger", "basetrainer.callbacks.wandb_logger"]),
    ("Metrics and evaluation", ["basetrainer.metric.accuracy_recorder", "basetrainer.metric.metric_recorder",
                                "basetrainer.metric.eval_tools", "basetrainer.metric.map_tools"]),
    ("Builders", ["basetrainer.criterion.criterion", "basetrainer.optimizer.build_optimizer",
                  "basetrainer.scheduler.build_scheduler", "basetrainer.models.build_models",
                  "basetrainer.dataloader.image_folder", "basetrainer.dataloader.data_resample"]),
    ("Utilities", ["basetrainer.utils.setup_config", "basetrainer.utils.log", "basetrainer.utils.file_utils",
                   "basetrainer.utils.torch_tools", "basetrainer.utils.torchcam_utils"]),
    ("Pruning", ["basetrainer.pruning.nni_pruning", "basetrainer.pruning.slim"]),
    ("Export and deploy", ["basetrainer.utils.converter.pytorch2onnx", "basetrainer.utils.converter.onnx2mnn",
                           "basetrainer.utils.converter.onnx2ncnn", "basetrainer.utils.converter.pytorch2ncnn",
                           "basetrainer.utils.converter.onnx2trt", "basetrainer.engine.onnx_engine",
                           "basetrainer.engine.mnn_engine", "basetrainer.engine.ncnn_engine",
                           "basetrainer.engine.openvino_engine", "basetrainer.engine.trt_engine",
                           "basetrainer.engine.rknn_engine", "basetrainer.deploy.parity", "basetrainer.deploy.latency", "basetrainer.deploy.report",
                           "basetrainer.deploy.engines.base"]),
    ("Sharded checkpoints", ["basetrainer.runtime.sharded"]),
]
API_SECTION = "API reference"
API_DIR = "reference/api"

CONFIG_PAGE = "configuration.md"
CONFIG_MARKER = "<!-- config-keys -->"
# where a key is explained at length (the table links there)
KEY_PAGES: Dict[str, str] = {
    "strategy": "large-models.md", "fsdp_wrap": "large-models.md", "reshard_after_forward": "large-models.md",
    "activation_checkpointing": "large-models.md", "fsdp_meta_init": "large-models.md",
    "loggers": "trackers.md", "mlflow_uri": "trackers.md",
    "resume": "checkpoints.md#resume", "overwrite": "checkpoints.md#a-rerun-into-a-used-folder",
    "schedule_on_resume": "checkpoints.md#resume",
    "start_save": "checkpoints.md#what-a-run-writes", "gpu_id": "modes.md", "distributed": "modes.md",
    "sync_bn": "modes.md#ddp-equals-one-process", "seed_per_sample": "modes.md#randomness",
    "loss_reduction": "modes.md#ddp-equals-one-process", "use_prune": "pruning.md",
    "amp": "training-options.md", "accumulate_steps": "training-options.md",
    "clip_grad_norm": "training-options.md", "channels_last": "training-options.md",
    "compile": "training-options.md", "progress": "callbacks.md#progress-bars",
    "balance": "evaluate.md#class-imbalance-balance-and-dataresample",
}

INSTALL_PAGE = "install.md"
PINS_MARKER = "<!-- floor-pins -->"

INCLUDE = re.compile(r"^<!-- include: (?P<name>[\w./-]+) -->$", re.M)


# ---------------------------------------------------------------------------------- modules
def module_source(dotted: str) -> Optional[str]:
    """The file of a module of this checkout (``pkg/__init__.py`` for a package), or None."""
    base = os.path.join(ROOT, *dotted.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def summary(path: str) -> str:
    """The first sentence of a module's docstring (read without importing it)."""
    with open(path, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    first = " ".join(doc.strip().split("\n\n", 1)[0].split())
    return roles_to_markdown(first).replace("|", "\\|")


def api_modules() -> List[Tuple[str, List[str]]]:
    """API_GROUPS less the modules (and groups) this checkout does not have."""
    groups = []
    for title, modules in API_GROUPS:
        present = [m for m in modules if module_source(m)]
        if present:
            groups.append((title, present))
    return groups


def api_page(dotted: str) -> str:
    package = module_source(dotted).endswith("__init__.py") and dotted != "basetrainer"
    options = ["        show_submodules: true"] if package else []
    lines = [f"# `{dotted}`", "", f"::: {dotted}", "    options:", "        show_root_heading: false"]
    return "\n".join(lines + options) + "\n"


def api_index(groups: List[Tuple[str, List[str]]]) -> str:
    lines = ["# API reference", "",
             "Generated from the docstrings at every build of this site. The import paths are the "
             "real homes of the names (no alias modules); see [Writing a trainer](../../trainer.md) "
             "for how they fit together.", ""]
    for title, modules in groups:
        lines += [f"## {title}", "", "| module | what it holds |", "|---|---|"]
        for m in modules:
            lines.append(f"| [`{m}`]({m}.md) | {summary(module_source(m))} |")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- config keys
def _value(v: Any) -> str:
    return json.dumps(v)   # None -> null, True -> true, "x" -> "x", [224, 224] -> [224, 224]


def _cell(text: str) -> str:
    return html.escape(text, quote=False).replace("|", "\\|")


def config_table() -> str:
    """The table of every engine key, from setup_config (imported from this checkout)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from basetrainer.utils import setup_config

    accepts = getattr(setup_config, "_CHECKS", {})
    rows = ["| key | default | accepts | meaning |", "|---|---|---|---|"]
    for key, (default, kind, meaning) in setup_config.ENGINE_KEYS.items():
        what = accepts[kind][1] if kind in accepts else kind
        more = f" ([more]({KEY_PAGES[key]}))" if key in KEY_PAGES else ""
        rows.append(f"| `{key}` | `{_value(default)}` | {_cell(what)} | {_cell(meaning)}{more} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------- floor pins
def floor_pins() -> str:
    """The versions CI's floor environment installs, from .ci/floor-constraints.txt, as one line."""
    pins = []
    with open(os.path.join(ROOT, ".ci", "floor-constraints.txt"), encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                name, version = (part.strip() for part in line.split("=="))
                pins.append(f"{name} {version}")
    return ", ".join(pins) + "."


# ---------------------------------------------------------------------------------- includes
def include(markdown: str, docs_dir: str, page_src: str) -> str:
    """Replace each ``<!-- include: NAME -->`` line with that docs file, its headings one level down."""
    def one(match: "re.Match[str]") -> str:
        path = os.path.join(docs_dir, match.group("name"))
        if not os.path.isfile(path):
            raise PluginError(f"{page_src}: '<!-- include: {match.group('name')} -->' names no file in {docs_dir}")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        out, fenced = [], False
        for line in text.splitlines():
            if line.startswith("```"):
                fenced = not fenced
            out.append("#" + line if line.startswith("#") and not fenced else line)
        return "\n".join(out)

    return INCLUDE.sub(one, markdown)


def changelog() -> str:
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        text = f.read()
    # its links are relative to the repository root; the site's pages sit in docs/
    text = re.sub(r"\]\(docs/", "](", text)
    return re.sub(r"\]\(README\.md", "](index.md", text)


# ---------------------------------------------------------------------------------- mkdocs events
def on_files(files: Files, config: Any) -> Files:
    groups = api_modules()
    files.append(File.generated(config, f"{API_DIR}/index.md", content=api_index(groups)))
    for _, modules in groups:
        for m in modules:
            files.append(File.generated(config, f"{API_DIR}/{m}.md", content=api_page(m),
                                        inclusion=InclusionLevel.NOT_IN_NAV))
    files.append(File.generated(config, "changelog.md", content=changelog()))
    return files


def on_nav(nav: Navigation, config: Any, files: Files) -> Navigation:
    """Put the module pages under the API reference section, after its index page."""
    section = _find_section(nav.items, API_SECTION)
    if section is None:
        raise PluginError(f"mkdocs.yml's nav has no section {API_SECTION!r} for the module pages")
    added: List[Page] = []
    for title, modules in api_modules():
        pages = [files.get_file_from_path(f"{API_DIR}/{m}.md").page for m in modules]
        group = Section(title, pages)
        group.parent = section
        for page in pages:
            page.parent = group
            page.title = m_title(page.file.src_uri)
        section.children.append(group)
        added += pages
    # previous/next links in reading order: the module pages follow the section's last page
    last_before = [p for p in _pages(section.children) if p not in added]
    at = nav.pages.index(last_before[-1]) + 1 if last_before else len(nav.pages)
    nav.pages[at:at] = added
    for i, page in enumerate(nav.pages):
        page.previous_page = nav.pages[i - 1] if i > 0 else None
        page.next_page = nav.pages[i + 1] if i + 1 < len(nav.pages) else None
    return nav


def m_title(src_uri: str) -> str:
    """The navigation's name for a module page: the module's last name (its group says the rest)."""
    return src_uri[len(API_DIR) + 1:-len(".md")].rsplit(".", 1)[-1]


def _find_section(items: List[Any], title: str) -> Optional[Section]:
    for item in items:
        if isinstance(item, Section):
            if item.title == title:
                return item
            found = _find_section(item.children, title)
            if found is not None:
                return found
    return None


def _pages(items: List[Any]) -> List[Page]:
    out: List[Page] = []
    for item in items:
        if isinstance(item, Page):
            out.append(item)
        elif isinstance(item, Section):
            out += _pages(item.children)
    return out


def on_page_markdown(markdown: str, page: Page, config: Any, files: Files) -> str:
    markdown = include(markdown, config["docs_dir"], page.file.src_uri)
    if page.file.src_uri == INSTALL_PAGE:
        if PINS_MARKER not in markdown:
            raise PluginError(f"{INSTALL_PAGE} lost its {PINS_MARKER} line: the tested versions go there")
        markdown = markdown.replace(PINS_MARKER, floor_pins())
    if page.file.src_uri == CONFIG_PAGE:
        if CONFIG_MARKER not in markdown:
            raise PluginError(f"{CONFIG_PAGE} lost its {CONFIG_MARKER} line: the key table goes there")
        markdown = markdown.replace(CONFIG_MARKER, config_table())
    return markdown
