"""What ``run()`` checks before training starts: a clear error instead of a failure deep inside
torch, or a run that silently trains nothing."""
from typing import Any

from basetrainer.engine import precision
from basetrainer.runtime.modules import unwrap_model


def check_ready(engine: Any) -> None:
    """Raise if ``engine`` cannot train as set up.

    Raises:
        RuntimeError: no model/optimizer for a train loader, no loader at all, or an optimizer
            holding none of the model's parameters (it would train nothing).
        ValueError: num_epochs, amp or accumulate_steps out of range.
    """
    name = type(engine).__name__
    missing = [key for key in ("model", "optimizer") if getattr(engine, key) is None]
    if engine.train_loader is not None and missing:
        raise RuntimeError(f"{name}.run(): {', '.join(missing)} not set; "
                           f"build them (build_model/build_optimizer) before run()")
    if engine.train_loader is None and engine.test_loader is None:
        raise RuntimeError(f"{name}.run(): neither train_loader nor test_loader is set")
    if engine.num_epochs is None or int(engine.num_epochs) <= 0:
        raise ValueError(f"num_epochs={engine.num_epochs!r} must be a positive integer")
    precision.check(engine.amp, engine.device, engine.accumulate_steps)
    if engine.train_loader is not None:
        model = {id(p) for p in unwrap_model(engine.model).parameters()}
        optimized = [p for group in engine.optimizer.param_groups for p in group["params"]]
        if model and optimized and not any(id(p) in model for p in optimized):
            raise RuntimeError(f"{name}.run(): the optimizer holds none of the model's parameters, so training "
                               f"would change nothing; build it from the wrapped model in build_optimizer "
                               f"(e.g. get_optimizer(self.model, ...)), after build_model")
