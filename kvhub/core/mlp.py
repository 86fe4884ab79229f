"""The residual MLP of an ``mlp`` map (kvhub.artifact.kinds): its forward pass and its training.

    y   = x @ W + b + r(x)               x (N, d_in): the ridge map's input (the selected source layers' K
                                         with RoPE stripped, or V); W (d_in, d_out), b: the ridge map
    h_0 = x
    h_i = act(h_{i-1} @ A_i + c_i)       (N, w)      i = 1..depth, stored as mlp.{i-1}
    r   = h_depth @ A_out + c_out        (N, d_out)  stored as mlp.{depth}

:func:`train_residual` fits r to the ridge residual Y - (X W + b) on sampled rows: inputs standardised per
feature (mean and std of the training rows), the residual divided by one scalar (the RMS of the target's
deviations from its mean, so the loss weighs the output dims as the pooled R^2 does), Adam on MSE in
mini-batches, every random draw from one seeded generator, and the last layer initialised to zero, so
training starts at the ridge map.  Early stopping on held-out rows keeps the best epoch; epoch 0 is the
ridge map itself, so the MLP map's held-out R^2 on those rows is never below the ridge map's.  The
standardisation and the scale are folded into A_1, c_1 and A_out, c_out: the stored tensors apply to raw x.
Deterministic for one device and thread count (the GEMM reductions depend on both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvhub.artifact import tensor_name
from kvhub.artifact.kinds import mlp_part

ACTIVATION_FUNCTIONS = {"gelu": F.gelu, "relu": F.relu}  # the names kvhub.artifact.kinds.ACTIVATIONS declares

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # [(A_i (in, out), c_i (out,))], i = 0..depth


def residual(parts: list[torch.Tensor], layers: Layers, activation: str) -> torch.Tensor:
    """r(x) for x = [x_1 | ... | x_k] given as its column blocks (..., d_j), all in one dtype (the layers too).

    The first layer's product is summed block by block (x is never concatenated), in fp32.  Returns a new
    fp32 (N, d_out) tensor, N = the product of the leading dims."""
    act = ACTIVATION_FUNCTIONS[activation]
    rows = [x.reshape(-1, x.shape[-1]) for x in parts]  # k x (N, d_j)
    first, bias = layers[0]
    blocks = first.split([x.shape[1] for x in rows])  # k x (d_j, w)
    hidden = sum((x @ block).float() for x, block in zip(rows, blocks))  # (N, w)
    hidden = act(hidden + bias.float())
    for weight, bias in layers[1:-1]:
        hidden = act(torch.addmm(bias, hidden.to(weight.dtype), weight).float())  # (N, w)
    weight, bias = layers[-1]
    return torch.addmm(bias, hidden.to(weight.dtype), weight).float()  # (N, d_out)


def residual_term(parts: list[torch.Tensor], prefix: str, settings: dict, weight) -> torch.Tensor:
    """r(x) of the map ``prefix`` (``k.3``) of an ``mlp`` mapper, its layers read through ``weight(name)``
    (the Mapper's cast, de-shrunk tensors): the term :data:`kvhub.core.mapper.RESIDUALS` adds for ``mlp``."""
    layers = [
        (weight(tensor_name(prefix, mlp_part(i, "weight"))), weight(tensor_name(prefix, mlp_part(i, "bias"))))
        for i in range(settings["depth"] + 1)
    ]
    return residual(parts, layers, settings["activation"])


def tensors_of(prefix: str, layers: Layers) -> dict[str, torch.Tensor]:
    """The artifact tensors of one map's residual MLP: ``{prefix}.mlp.{i}.weight`` / ``.bias``, fp32."""
    out = {}
    for i, (weight, bias) in enumerate(layers):
        out[tensor_name(prefix, mlp_part(i, "weight"))] = weight.float().contiguous()
        out[tensor_name(prefix, mlp_part(i, "bias"))] = bias.float().contiguous()
    return out


@dataclass(frozen=True)
class Schedule:
    """How one residual MLP is trained: its shape (``width``, ``depth`` hidden layers, ``activation``), at most
    ``epochs`` passes over the training rows in mini-batches of ``batch_size``, Adam at ``lr``, stopping after
    ``patience`` epochs without a better held-out loss; ``seed`` seeds every random draw."""

    width: int = 256
    depth: int = 2
    activation: str = "gelu"
    epochs: int = 100
    patience: int = 10
    lr: float = 1e-3
    batch_size: int = 256
    seed: int = 0


@dataclass
class Trained:
    """A trained residual MLP (``layers`` folded to raw x, fp32 on the CPU) and how its training went: epochs
    run, the best epoch (0: the ridge map, the MLP adds nothing), mean squared errors of y at the best epoch on
    the training and held-out rows, and held-out R^2 of the MLP map and of the ridge map alone (pooled)."""

    layers: Layers
    epochs: int
    best_epoch: int
    train_loss: float
    heldout_loss: float
    heldout_r2: float
    ridge_heldout_r2: float


def init_layers(d_in: int, d_out: int, schedule: Schedule, generator: torch.Generator) -> Layers:
    """Hidden layers drawn U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (as torch.nn.Linear) from ``generator``; the last
    layer zero, so r(x) = 0 at the start.  fp32 on the CPU."""
    widths = [d_in] + [schedule.width] * schedule.depth
    layers = []
    for fan_in, fan_out in zip(widths[:-1], widths[1:]):
        bound = 1 / math.sqrt(fan_in)
        weight = (torch.rand(fan_in, fan_out, generator=generator) * 2 - 1) * bound  # (in, out)
        bias = (torch.rand(fan_out, generator=generator) * 2 - 1) * bound
        layers.append((weight, bias))
    layers.append((torch.zeros(schedule.width, d_out), torch.zeros(d_out)))
    return layers


def _forward(x: torch.Tensor, params: list[torch.Tensor], activation: str) -> torch.Tensor:
    """r(x) (N, d_out) for x (N, d_in) and params [A_0, c_0, A_1, c_1, ...] (training: fp32, one device)."""
    act = ACTIVATION_FUNCTIONS[activation]
    hidden = x
    for i in range(0, len(params) - 2, 2):
        hidden = act(torch.addmm(params[i + 1], hidden, params[i]))
    return torch.addmm(params[-1], hidden, params[-2])


@torch.no_grad()
def _sse(x, target, params, activation: str, chunk: int = 8192) -> float:
    """sum((target - r(x))^2) in fp64, over row chunks of at most ``chunk``."""
    total = 0.0
    for start in range(0, x.shape[0], chunk):
        diff = target[start : start + chunk] - _forward(x[start : start + chunk], params, activation)
        total += float(diff.double().square().sum())
    return total


def train_residual(
    x: torch.Tensor,
    y: torch.Tensor,
    base: torch.Tensor,
    x_heldout: torch.Tensor,
    y_heldout: torch.Tensor,
    base_heldout: torch.Tensor,
    *,
    schedule: Schedule,
    device: torch.device | str = "cpu",
) -> Trained:
    """Train r on training rows x (N, d_in), y (N, d_out) with ridge predictions ``base`` (N, d_out), stopping
    early on the held-out rows (M, ...); see the module docstring.  Inputs are read, never changed."""
    generator = torch.Generator().manual_seed(schedule.seed)
    mean, std = x.mean(0), x.std(0, unbiased=False)  # (d_in,)
    std = std.clamp_min(1e-6 * float(std.max()) + 1e-30)
    scale = float(((y - y.mean(0)) ** 2).mean().sqrt()) or 1.0
    inputs = ((x - mean) / std).to(device)
    target = ((y - base) / scale).to(device)
    inputs_heldout = ((x_heldout - mean) / std).to(device)
    target_heldout = ((y_heldout - base_heldout) / scale).to(device)
    params = [
        t.to(device).requires_grad_()
        for layer in init_layers(x.shape[1], y.shape[1], schedule, generator)
        for t in layer
    ]
    best, epochs = _fit(params, inputs, target, inputs_heldout, target_heldout, schedule, generator)
    best_params, best_epoch, best_sse = best
    train_sse = _sse(inputs, target, best_params, schedule.activation)
    total_heldout = float((y_heldout - y_heldout.mean(0)).double().square().sum()) or 1e-30
    ridge_sse = float((y_heldout - base_heldout).double().square().sum())
    elements = max(y.numel(), 1), max(y_heldout.numel(), 1)
    return Trained(
        layers=_fold([p.detach().cpu() for p in best_params], mean, std, scale),
        epochs=epochs,
        best_epoch=best_epoch,
        train_loss=train_sse * scale**2 / elements[0],
        heldout_loss=best_sse * scale**2 / elements[1],
        heldout_r2=1 - best_sse * scale**2 / total_heldout,
        ridge_heldout_r2=1 - ridge_sse / total_heldout,
    )


def _fit(params, inputs, target, inputs_heldout, target_heldout, schedule: Schedule, generator):
    """Adam epochs with early stopping; returns ((best params, best epoch, best held-out SSE), epochs run)."""
    optimizer = torch.optim.Adam(params, lr=schedule.lr)
    best = ([p.detach().clone() for p in params], 0, _sse(inputs_heldout, target_heldout, params, schedule.activation))
    epoch = 0
    for epoch in range(1, schedule.epochs + 1):
        order = torch.randperm(inputs.shape[0], generator=generator).to(inputs.device)
        for start in range(0, inputs.shape[0], schedule.batch_size):
            rows = order[start : start + schedule.batch_size]
            loss = F.mse_loss(_forward(inputs[rows], params, schedule.activation), target[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        sse = _sse(inputs_heldout, target_heldout, params, schedule.activation)
        if sse < best[2]:
            best = ([p.detach().clone() for p in params], epoch, sse)
        elif epoch - best[1] >= schedule.patience:
            break
    return best, epoch


def _fold(params: list[torch.Tensor], mean: torch.Tensor, std: torch.Tensor, scale: float) -> Layers:
    """The layers of the trained MLP on standardised x and scaled output, rewritten for raw x and y:
    A_0' = A_0 / std (rows), c_0' = c_0 - (mean / std) @ A_0; A_out' = scale A_out, c_out' = scale c_out."""
    layers = [(params[i].clone(), params[i + 1].clone()) for i in range(0, len(params), 2)]
    first, bias = layers[0]
    layers[0] = (first / std[:, None], bias - (mean / std) @ first)
    last, bias = layers[-1]
    layers[-1] = (last * scale, bias * scale)
    return [(w.float().contiguous(), b.float().contiguous()) for w, b in layers]
