"""The device side of serving: bucketed, ahead-of-time compiled, donated steps.

* :mod:`kvjax.runner.runner` — :class:`RunnerConfig`, :class:`Runner`, the step function.
* :mod:`kvjax.runner.packing` — one packed host-to-device buffer per step.
* :mod:`kvjax.runner.compile_guard` — counts compiles; makes a serving-time compile an error.
* :mod:`kvjax.runner.serving` — the serving loop, lockstep or overlapped.
* :mod:`kvjax.runner.memory` — the memory a configuration needs, estimated before compiling.
* :mod:`kvjax.runner.mesh` — serving over a ``("data", "model")`` device mesh.
"""

from kvjax.runner.runner import (
    DeviceState as DeviceState,
    Runner as Runner,
    RunnerConfig as RunnerConfig,
    StepInputs as StepInputs,
    StepOutput as StepOutput,
    step_fn as step_fn,
)

__all__ = ["DeviceState", "Runner", "RunnerConfig", "StepInputs", "StepOutput", "step_fn"]
