"""Where ftbridge meets DeepSpeed's *engine* (its optimizer is :mod:`ftbridge.zero.stages`' job).

* :func:`check_deepspeed_version`: the releases whose internals ftbridge was checked against;
* :func:`check_accumulation_settings`: engine features whose optimizer steps ftbridge cannot make exact;
* :func:`wrap_model_step`: the one point where DeepSpeed applies an optimizer step, whichever way the
  caller ended the accumulation window;
* :func:`align_to_window`: DeepSpeed's ``micro_steps`` counter rounded to a window start (resume, heal);
* :func:`gradient_reduction`: whether the engine averages or sums gradients over its ranks.
"""

from __future__ import annotations

from typing import Any, Callable

import deepspeed

SUPPORTED_DEEPSPEED = ("0.19.",)
"""DeepSpeed release prefixes whose internals this module was checked against."""


def check_deepspeed_version(version: str = deepspeed.__version__) -> None:
    """Refuse a DeepSpeed release whose internals ftbridge has not been checked against.

    Raises:
        RuntimeError: naming the installed and the supported versions.
    """
    if not version.startswith(SUPPORTED_DEEPSPEED):
        raise RuntimeError(
            f"ftbridge patches DeepSpeed internals checked against deepspeed "
            f"{', '.join(p + 'x' for p in SUPPORTED_DEEPSPEED)}; found {version}. "
            "Install a supported release: pip install 'deepspeed>=0.19,<0.20'"
        )


def wrap_model_step(engine: Any, run: Callable[..., None]) -> None:
    """Make DeepSpeed call ``run(original, *args, **kwargs)`` where it would step the optimizer.

    Replaces ``DeepSpeedEngine._take_model_step`` (deepspeed 0.19) on the engine *instance*; it runs
    once per optimizer step, whichever way the boundary was set, after the partition is assembled.
    """
    original = engine._take_model_step

    def _take_model_step(*args: Any, **kwargs: Any) -> None:
        run(original, *args, **kwargs)

    engine._take_model_step = _take_model_step


def align_to_window(micro_steps: int, gradient_accumulation_steps: int) -> int:
    """The smallest ``m >= micro_steps`` at which a managed window of ``gas`` micro-steps starts
    (DeepSpeed closes one when ``(micro_steps + 1) % gas == 0``); for a counter saved under another ``gas``.
    """
    gas = max(1, int(gradient_accumulation_steps))
    return -(-int(micro_steps) // gas) * gas


def gradient_reduction(engine: Any) -> str:
    """``"mean"`` or ``"sum"``: how ``engine`` reduces gradients over its group's ranks
    (DeepSpeed's ``gradient_allreduce_op``); the cross-replica reduction follows it. Why:
    docs/concepts.md, "Where the sync sits in a ZeRO step".
    """
    return "mean" if getattr(engine, "gradient_average", True) else "sum"


def check_accumulation_settings(engine: Any) -> None:
    """Refuse the DeepSpeed settings whose optimizer steps ftbridge cannot make exact.

    Raises:
        ValueError: naming the setting and the fix: ZenFlow, pipeline parallelism or DeepCompile.
    """
    if getattr(engine, "zenflow", False):
        raise ValueError("zero_optimization.zenflow updates parameters selectively and asynchronously, which "
                         "the cross-replica commit cannot follow: remove the zenflow section for ftbridge")
    if getattr(engine, "pipeline_parallelism", False):
        raise ValueError("pipeline parallelism (deepspeed.pipe.PipelineModule) is not supported by ftbridge: "
                         "pass a plain torch.nn.Module")
    compiled = getattr(engine, "is_deepcompile_enabled", None)
    if compiled is not None and compiled():
        raise ValueError("DeepCompile (compile.deepcompile) reduces gradients in its compiled graph, where "
                         "ftbridge's cross-replica hook cannot run: set compile.deepcompile to false")
