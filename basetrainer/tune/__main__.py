"""``python -m basetrainer.tune SCRIPT --space search.yaml [--trials N] [--timeout S] [--objective K]
[--direction maximize|minimize] [script args...]``: exit status 0 when the search ran, 2 on bad input
(one line naming the key, the value and the fix, before any trial runs)."""
import os
import sys
from typing import Optional, Sequence

from basetrainer.tune import search, space
from basetrainer.utils import log


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    work_dir = ""
    try:
        search.require_optuna()
        script, options, script_args = search.split_args(argv)
        known, typed = search.script_keys(script, script_args)
        settings = space.load(options["space"], known, typed)
        for key in ("trials", "timeout"):
            if key in options:
                try:
                    settings[key] = int(options[key])
                except ValueError:
                    raise space.SearchError(f"--{key} = {options[key]!r} must be an integer") from None
                if settings[key] < (1 if key == "trials" else 0):
                    raise space.SearchError(f"--{key} = {options[key]!r} must be an integer >= "
                                            f"{1 if key == 'trials' else 0}")
        for key in ("objective", "direction"):
            if key in options:
                settings[key] = options[key]
        if settings["direction"] not in ("", "maximize", "minimize"):
            raise space.SearchError(f"--direction = {settings['direction']!r} must be maximize or minimize")
        searched = [k for k in settings["params"] if search.flag_value(script_args, f"--{k}") is not None]
        if searched:
            raise space.SearchError(f"--{searched[0]} is typed on the command line and searched in params; "
                                    f"remove one of them")
        work_dir = (settings["work_dir"] or search.flag_value(script_args, "--work_dir")
                    or (typed.get("work_dir") and os.path.join(typed["work_dir"], "tune")) or "work_space/tune")
        study = search.Search(script, script_args, settings, work_dir).run()
    except space.SearchError as e:
        print(f"basetrainer.tune: error: {e}", file=sys.stderr, flush=True)
        return 2
    except search.write_errors() as e:   # a full disk or an unwritable work_dir: the study keeps what it has
        print(f"basetrainer.tune: error: work_dir {os.path.abspath(work_dir)}: {str(e).splitlines()[0]}; free space "
              f"there (or give another work_dir) and run the same command again to continue", file=sys.stderr,
              flush=True)
        return 1
    from basetrainer.tune import report

    best = report.best_trial(study)
    states = [("INTERRUPTED" if t.user_attrs.get("interrupted") else t.state.name)
              for t in study.get_trials(deepcopy=False)]
    print(f"search: {states.count('COMPLETE')} complete, {states.count('PRUNED')} pruned, "
          f"{states.count('FAIL')} failed, {states.count('INTERRUPTED')} interrupted (retried); best: "
          + (f"trial {best.number} {best.value:.4f} {best.params}" if best else "none")
          + f"; results in {os.path.abspath(work_dir)} (trials.md, best.yaml, history.png)", flush=True)
    return 0


if __name__ == "__main__":
    log.set_logger("info")   # the command's own output: the search's progress lines (one per trial);
    sys.exit(main())         # main() called from Python leaves the caller's logging alone
