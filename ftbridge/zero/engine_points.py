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

    ``DeepSpeedEngine._take_model_step`` (deepspeed 0.19) runs exactly when
    DeepSpeed applies an optimizer step, whichever way the caller set the
    accumulation boundary, after DeepSpeed assembled the gradient partition
    (including the unmanaged finalize). It is replaced on the engine
    *instance*; the class is untouched.
    """
    original = engine._take_model_step

    def _take_model_step(*args: Any, **kwargs: Any) -> None:
        run(original, *args, **kwargs)

    engine._take_model_step = _take_model_step


def align_to_window(micro_steps: int, gradient_accumulation_steps: int) -> int:
    """The smallest ``m >= micro_steps`` at which a managed accumulation window starts.

    DeepSpeed closes a window when ``(micro_steps + 1) % gas == 0``; a counter
    saved under another ``gas`` (a resume with a different accumulation count)
    would otherwise close the first window early and shift every later one.
    """
    gas = max(1, int(gradient_accumulation_steps))
    return -(-int(micro_steps) // gas) * gas


def gradient_reduction(engine: Any) -> str:
    """``"mean"`` or ``"sum"``: how ``engine`` reduces gradients over its group's ranks.

    DeepSpeed 0.19's ``gradient_allreduce_op`` (default ``"mean"``) sets the engine's
    ``gradient_average``, which its ZeRO-1/2 optimizers and its bf16 all-reduce read;
    DeepSpeed refuses ``"sum"`` with ZeRO-3. ``gradient_predivide_factor`` and
    ``prescale_gradients`` change only where the mean's division happens, not its value.
    The cross-replica reduction must follow it: each group's partition then holds its
    ranks' sum, and plain DeepSpeed would sum over every rank of the job.
    """
    return "mean" if getattr(engine, "gradient_average", True) else "sum"


def check_accumulation_settings(engine: Any) -> None:
    """Refuse the DeepSpeed settings whose optimizer steps ftbridge cannot make exact.

    Raises:
        ValueError: naming the setting and the fix: ZenFlow (selective,
            asynchronous updates), pipeline parallelism (its own engine), or
            DeepCompile (its compiled graph reduces gradients itself).
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
