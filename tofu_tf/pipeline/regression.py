r"""A statistical model of a stage's measured peak, fitted on profiled stages (CAPTURE).

This module owns the regression that turns the analytic figures of a
pipeline stage into a predicted peak, the data it is fitted on, and its error.
It imports no TensorFlow: samples come from profiling runs
(``tofu_tf.pipeline.profile``) and are stored as JSON.

The model. For a stage holding layers :math:`[i, j)` with :math:`k` micro-batches
in flight, with the analytic figures of ``LayerStats``:

.. math::

    S = \sum_l \mathrm{state}_l, \quad
    A = k \sum_l \mathrm{activation}_l, \quad
    W = \max_l (\mathrm{state}_l + \mathrm{transient}_l), \quad
    C = \max_l \mathrm{workspace}_l

    \widehat{\mathrm{peak}} = \beta_0 + \beta_S S + \beta_A A + \beta_W W + \beta_C C

``W``, the largest working set of one layer, stands for what the analytic
figures leave out and that scales with the biggest layer rather than with the
stage: the gradient accumulator, per-micro-batch gradients and the
optimizer's temporaries while one layer's weights are updated, on top of its
forward/backward temporaries. (A plain ``max transient`` term was tried first:
its fitted weight was 0 and the fit's error 16%.)

``C``, the largest convolution workspace, is the im2col buffer TensorFlow's
CPU kernels of a convolution's input and filter gradients allocate
(``graph_stats.convolution_workspace_bytes``): sized to fill a hard-coded
30 MiB cache rather than by the batch, it is tens of MiB for the small
convolutions of a CIFAR-sized network and dwarfs the analytic figures (a
WRN-16-2 stage measured 20-30 MiB for 1-10 MiB of state and activations).
Without it a regression fitted on Transformers and MLPs was off by 63% on
WRN-16-2's stages; its fitted weight is close to 1. It is 0 for models
without 2-D convolutions, which the other four terms describe alone.

fitted by non-negative least squares on relative residuals (each sample's row
divided by its measured peak, so small and large stages weigh alike and the
fit minimises something close to the percentage error). Non-negative because
each term is memory that can only add. The error reported is the
leave-one-out mean absolute percentage error: each sample predicted by the
model fitted on all the others.

Because the prediction is affine in the figures with non-negative weights,
scaling the figures (``scaled``) lets the exact partitioner minimise the
predicted peak directly.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import numpy as np
from scipy.optimize import nnls

from tofu_tf.pipeline.stats import LayerStats

SAMPLES_VERSION = 2  # 2: per-layer workspace_bytes (convolution workspaces)
DEFAULT_SAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                               "cpu_bfc_samples.json")
FEATURES = ("intercept", "state", "inflight_activation", "largest_working_set",
            "largest_conv_workspace")


@dataclasses.dataclass(frozen=True)
class StageSample:
    """One measured stage: the analytic figures of its layers, the micro-batches
    in flight, and its measured peak (bytes). ``workspace_bytes`` left empty
    means no convolution workspace in any layer."""

    model: str
    inflight: int
    state_bytes: tuple[int, ...]       # per layer of the stage
    activation_bytes: tuple[int, ...]
    transient_bytes: tuple[int, ...]
    measured_bytes: int
    workspace_bytes: tuple[int, ...] = ()

    def __post_init__(self):
        if not tuple(self.workspace_bytes):
            object.__setattr__(self, "workspace_bytes", (0,) * len(tuple(self.state_bytes)))
        for field in _PER_LAYER:
            object.__setattr__(self, field, tuple(int(v) for v in getattr(self, field)))
        if not self.state_bytes or len({len(getattr(self, f)) for f in _PER_LAYER}) != 1:
            raise ValueError(f"sample of {self.model!r}: per-layer figures must be non-empty "
                             "and of equal length")

    @classmethod
    def of(cls, model: str, stats: Sequence[LayerStats], inflight: int,
           measured_bytes: int) -> "StageSample":
        """The sample of a stage holding ``stats`` with ``inflight`` micro-batches alive."""
        return cls(model=model, inflight=int(inflight),
                   state_bytes=tuple(s.state_bytes for s in stats),
                   activation_bytes=tuple(s.activation_bytes for s in stats),
                   transient_bytes=tuple(s.transient_bytes for s in stats),
                   workspace_bytes=tuple(s.workspace_bytes for s in stats),
                   measured_bytes=int(measured_bytes))

    def features(self) -> np.ndarray:
        """``(1, S, A, W, C)``: see the module docstring."""
        working = max(s + t for s, t in zip(self.state_bytes, self.transient_bytes))
        return np.array([1.0, sum(self.state_bytes), self.inflight * sum(self.activation_bytes),
                         working, max(self.workspace_bytes)], dtype=np.float64)


@dataclasses.dataclass(frozen=True)
class MemoryRegression:
    """``peak = b0 + bS * S + bA * A + bW * W + bC * C`` (bytes; see the module
    docstring). Four coefficients (a regression without the workspace term) are
    read as ``bC = 0``."""

    coefficients: tuple[float, float, float, float, float]
    num_samples: int
    fit_mape: float          # in-sample mean absolute percentage error
    loo_mape: float          # leave-one-out mean absolute percentage error
    models: tuple[str, ...]  # the models the samples came from

    def __post_init__(self):
        coefficients = tuple(float(c) for c in self.coefficients)
        if len(coefficients) == len(FEATURES) - 1:
            coefficients += (0.0,)
        if len(coefficients) != len(FEATURES):
            raise ValueError(f"a MemoryRegression has {len(FEATURES)} coefficients "
                             f"({', '.join(FEATURES)}), got {len(coefficients)}")
        object.__setattr__(self, "coefficients", coefficients)

    @classmethod
    def fit(cls, samples: Sequence[StageSample]) -> "MemoryRegression":
        """Non-negative least squares on relative residuals (see the module docstring)."""
        samples = list(samples)
        if len(samples) < len(FEATURES) + 1:
            raise ValueError(f"fitting the memory regression needs at least {len(FEATURES) + 1} "
                             f"measured stages, got {len(samples)}; profile more stages")
        x = np.stack([s.features() for s in samples])
        y = np.array([s.measured_bytes for s in samples], dtype=np.float64)
        if (y <= 0).any():
            raise ValueError("a measured stage peak is <= 0 bytes: the samples are corrupt")
        coefficients = _solve(x, y)
        fit_error = _mape(x @ coefficients, y)
        return cls(coefficients=tuple(float(c) for c in coefficients), num_samples=len(samples),
                   fit_mape=fit_error, loo_mape=_mape(_leave_one_out(x, y), y),
                   models=tuple(sorted({s.model for s in samples})))

    def predict(self, sample: StageSample) -> float:
        """The predicted peak of ``sample``'s stage (its ``measured_bytes`` is not read)."""
        return float(np.asarray(self.coefficients) @ sample.features())

    def predict_stage(self, stats: Sequence[LayerStats], inflight: int) -> float:
        return self.predict(StageSample.of("", stats, inflight, 0))

    def scaled(self, stats: Sequence[LayerStats]) -> list[LayerStats]:
        r"""Layers whose analytic stage peak is this regression's prediction minus ``b0``.

        The stage model sums state, multiplies activations by the in-flight
        count and takes the largest transient, exactly the regression's
        features; scaling each figure by its coefficient makes the exact
        partitioner minimise the predicted peak. The two largest-layer terms
        share the one transient, :math:`\max_l (\beta_W w_l + \beta_C c_l)`: the
        prediction exactly when one layer holds both the largest working set
        and the largest workspace (or the stage has no convolution), below it
        by at most :math:`\min(\beta_W W, \beta_C C)` otherwise. Measured
        figures are dropped.
        """
        _, b_state, b_act, b_working, b_workspace = self.coefficients
        return [dataclasses.replace(
            s, state_bytes=round(b_state * s.state_bytes),
            activation_bytes=round(b_act * s.activation_bytes),
            transient_bytes=round(b_working * (s.state_bytes + s.transient_bytes)
                                  + b_workspace * s.workspace_bytes),
            workspace_bytes=0, isolated_bytes=None, added_bytes=None) for s in stats]

    def describe(self) -> str:
        b0, b_state, b_act, b_working, b_workspace = self.coefficients
        return (f"peak = {b0 / 2**20:.3f} MiB + {b_state:.3f} S + {b_act:.3f} A + "
                f"{b_working:.3f} W + {b_workspace:.3f} C "
                f"({self.num_samples} measured stages of {', '.join(self.models)}; "
                f"fit MAPE {100 * self.fit_mape:.1f}%, leave-one-out MAPE "
                f"{100 * self.loo_mape:.1f}%)")


_PER_LAYER = ("state_bytes", "activation_bytes", "transient_bytes", "workspace_bytes")


def errors_by_model(samples: Sequence[StageSample]) -> dict[str, tuple[float, float]]:
    """Per model of ``samples``: the in-sample and the leave-one-out MAPE of the
    regression fitted on all of them (each sample predicted without itself)."""
    samples = list(samples)
    fitted = MemoryRegression.fit(samples)
    x = np.stack([s.features() for s in samples])
    y = np.array([s.measured_bytes for s in samples], dtype=np.float64)
    fit, loo = x @ np.asarray(fitted.coefficients), _leave_one_out(x, y)
    errors = {}
    for model in fitted.models:
        mask = np.array([s.model == model for s in samples])
        errors[model] = (_mape(fit[mask], y[mask]), _mape(loo[mask], y[mask]))
    return errors


def _leave_one_out(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.array([x[i] @ _solve(np.delete(x, i, 0), np.delete(y, i)) for i in range(len(y))])


def _solve(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """NNLS of ``x @ b ~= y`` in relative terms, columns normalised for conditioning."""
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    rows = (x / scale) / y[:, None]
    solution, _ = nnls(rows, np.ones_like(y))
    return solution / scale


def _mape(predicted: np.ndarray, measured: np.ndarray) -> float:
    return float(np.mean(np.abs(predicted - measured) / measured))


def save_samples(samples: Sequence[StageSample], path: str, *, source: str) -> None:
    """Write ``samples`` as versioned JSON (``source`` says how they were measured)."""
    data = {"version": SAMPLES_VERSION, "source": source,
            "samples": [dataclasses.asdict(s) for s in samples]}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as handle:
        json.dump(data, handle, indent=1)
        handle.write("\n")


def load_samples(path: str = DEFAULT_SAMPLES) -> list[StageSample]:
    """Samples written by ``save_samples``; refuses other versions."""
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"no measured stage samples at {path}; run `python bench/pipeline.py --calibrate` "
            "to profile them, or pass a MemoryRegression fitted on your own")
    with open(path) as handle:
        data = json.load(handle)
    if data.get("version") != SAMPLES_VERSION:
        raise ValueError(f"{path} holds samples of version {data.get('version')!r}; this tofu_tf "
                         f"reads version {SAMPLES_VERSION}: measure them again with "
                         "`python bench/pipeline.py --calibrate`")
    return [StageSample(**row) for row in data["samples"]]


def default_regression() -> MemoryRegression:
    """The regression fitted on the samples shipped with tofu_tf (measured on CPU,
    TensorFlow's BFC allocator, by ``bench/pipeline.py --calibrate``)."""
    return MemoryRegression.fit(load_samples(DEFAULT_SAMPLES))
