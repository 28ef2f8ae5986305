"""Workers for tied embeddings across a pipeline, with Hugging Face weights loaded into each rank's stage."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.fabric import Fabric

from lightning_sppo import GPT, SPPOStrategy
from lightning_sppo.model.hf import hf_names, load_hf_model, load_hf_weights
from lightning_sppo.strategy import checkpoint
from tests.conftest import full_tensor, make_batch, plain_loss_and_grads, relative_error

LR = 0.1
S = 40


def _plain_name(name: str) -> str:
    """The tied weight is one parameter of the plain model, named after the embedding."""
    return "wte.weight" if name == "lm_head.weight" else name


def tied_pipeline(rank: int, world_size: int, pp: int, hf_path: str, out: str, schedule: str = "seq1f1b") -> None:
    """A tied model (from HF weights) on pp stages x dp: each rank reads only its stage's tensors; loss, every
    gradient, the clipped global norm and an SGD step equal the plain tied model's; without the gradient sum
    the two copies' gradients are each only part of it (negative control). Then writes both checkpoint formats."""
    import lightning_sppo.strategy.core as core

    dp = world_size // pp
    plain = load_hf_model(hf_path)
    config = plain.config
    assert config.tie_embeddings
    ids, targets = make_batch(config, 2 * dp, S, seed=3)
    ref_loss, ref_grads = plain_loss_and_grads(plain, ids, targets)

    fabric = Fabric(
        strategy=SPPOStrategy(pipeline_parallel=pp, num_subsequences=3, partition="flops", schedule=schedule),
        accelerator="cpu",
        devices=world_size,
    )
    fabric.launch()
    with torch.device("meta"):
        model = GPT(config)
    stage = fabric.setup_module(model)  # fresh random weights; the last stage took the first stage's copy
    gpt = stage.module  # the GPT, cut in place to this rank's stage
    first, last = gpt.wte is not None, gpt.lm_head is not None
    copies = [None] * world_size
    dist.all_gather_object(
        copies, full_tensor(gpt.wte.weight if first else gpt.lm_head.weight).detach() if first or last else None
    )
    assert torch.equal(copies[0], copies[-1]), rank  # stage 0's and the last stage's copies, dp rank 0 and last
    assert not torch.equal(copies[0], plain.wte.weight)

    read = load_hf_weights(gpt, hf_path)
    expected = {hf for name, _ in gpt.named_parameters() for hf in hf_names(name, config)}
    everything = {hf for name in plain.state_dict() for hf in hf_names(name, config)}
    assert set(read) == expected and (len(read) < len(everything) or pp == 1)  # a stage reads only its own
    optimizer = fabric.setup_optimizers(torch.optim.SGD(stage.parameters(), lr=LR))
    dp_rank = fabric.strategy.dims.coordinates(rank)[1]
    rows = slice(dp_rank * 2, dp_rank * 2 + 2)

    summed = core.tied_gradients_summed
    core.tied_gradients_summed = lambda module: contextlib.nullcontext()  # negative control: each keeps its share
    fabric.strategy.forward_backward(stage, ids[rows], targets[rows])
    core.tied_gradients_summed = summed
    for name, param in gpt.named_parameters():
        err = relative_error(full_tensor(param.grad), ref_grads[_plain_name(name)])
        assert (err > 1e-2) if (name in ("wte.weight", "lm_head.weight") and pp > 1) else (err < 1e-5), (name, err)
    optimizer.zero_grad()

    # Gradients accumulated over two calls (each dp rank's first row, then its second): each call's share of the
    # tied weight is summed once, what earlier calls left is not summed again.
    halves = [plain_loss_and_grads(plain, ids[h::2], targets[h::2])[1] for h in (0, 1)]
    for h in (0, 1):
        row = slice(rows.start + h, rows.start + h + 1)
        fabric.strategy.forward_backward(stage, ids[row], targets[row])
    for name, param in gpt.named_parameters():
        expected_grad = halves[0][_plain_name(name)] + halves[1][_plain_name(name)]
        err = relative_error(full_tensor(param.grad), expected_grad)
        assert err < 1e-5, f"rank {rank}: accumulated grad of {name} off by {err}"
    optimizer.zero_grad()

    loss = fabric.strategy.forward_backward(stage, ids[rows], targets[rows])
    case = f"rank {rank} pp={pp} dp={dp}"
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5, (case, loss.item(), ref_loss.item())
    for name, param in gpt.named_parameters():
        err = relative_error(full_tensor(param.grad), ref_grads[_plain_name(name)])
        assert err < 1e-5, f"{case}: grad of {name} off by {err}"
    ref_norm = torch.stack([g.norm() for g in ref_grads.values()]).norm()  # the tied weight counted once
    norm = fabric.clip_gradients(stage, optimizer, max_norm=0.5 * ref_norm.item())
    assert abs(norm.item() - ref_norm.item()) / ref_norm.item() < 1e-5, (case, norm.item(), ref_norm.item())
    optimizer.step()
    scale = 0.5 * ref_norm / (ref_norm + 1e-6)
    plain_params = dict(plain.named_parameters())
    for name, param in gpt.named_parameters():
        expected_param = plain_params[_plain_name(name)].detach() - LR * scale * ref_grads[_plain_name(name)]
        err = relative_error(full_tensor(param.detach()), expected_param)
        assert err < 1e-5, f"{case}: {name} after SGD off by {err}"

    # Both formats; model_config as checkpoints record it, so that sppo-export needs no --model.
    state = {"model": stage, "optimizer": optimizer, "model_config": config.to_dict()}
    fabric.save(Path(out) / "distributed", state)
    unwrapped = state | {"model": stage._forward_module, "optimizer": optimizer.optimizer}  # what fabric.save passes
    checkpoint.save_checkpoint(Path(out) / "single.pt", unwrapped, distributed=False)
    if rank == 0:  # the plain model after the same step, to compare the exports with
        for name, param in plain.named_parameters():
            param.data -= LR * scale * ref_grads[name]
        torch.save(plain.state_dict(), Path(out) / "expected.pt")


def _adamw_run(world_size: int, pp: int, config, hf_path: str | None = None):
    fabric = Fabric(strategy=SPPOStrategy(pipeline_parallel=pp, num_subsequences=2), accelerator="cpu",
                    devices=world_size)  # fmt: skip
    fabric.launch()
    with torch.device("meta"):
        model = GPT(config)
    stage = fabric.setup_module(model)
    if hf_path is not None:
        load_hf_weights(stage.module, hf_path)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(stage.parameters(), lr=1e-3))
    return fabric, stage, optimizer


def _tied_exp_avg(stage, optimizer) -> torch.Tensor | None:
    """The AdamW first moment of this rank's copy of the tied weight (full tensor), or None where it has none."""
    gpt = stage.module
    weight = gpt.wte.weight if gpt.wte is not None else gpt.lm_head.weight if gpt.lm_head is not None else None
    return None if weight is None else full_tensor(optimizer.state[weight]["exp_avg"]).clone()


def tied_optimizer_state_across_layouts(rank: int, world_size: int, hf_path: str, out: str) -> None:
    """AdamW state of a tied weight moves between layouts in both formats: saved without a pipeline (one
    parameter, its state under the embedding's name) it lands on both pipeline copies; saved by a pipeline (two
    copies, two equal states) it loads back into the one parameter."""
    config = load_hf_model(hf_path).config
    ids, targets = make_batch(config, 2, S, seed=5)
    fabric, stage, optimizer = _adamw_run(world_size, 1, config, hf_path)  # pp=1, dp=2: FSDP on the tied weight
    dp_rank = fabric.strategy.dims.coordinates(rank)[1]
    fabric.strategy.forward_backward(stage, ids[dp_rank : dp_rank + 1], targets[dp_rank : dp_rank + 1])
    optimizer.step()
    saved = _tied_exp_avg(stage, optimizer)
    assert saved is not None and saved.abs().sum() > 0
    state = {"model": stage, "optimizer": optimizer}
    fabric.save(Path(out) / "pp1-distributed", state)
    unwrapped = state | {"model": stage._forward_module, "optimizer": optimizer.optimizer}
    checkpoint.save_checkpoint(Path(out) / "pp1-single.pt", unwrapped, distributed=False)

    for source in ("pp1-distributed", "pp1-single.pt"):
        fabric, stage, optimizer = _adamw_run(world_size, 2, config)  # pp=2: a copy on each stage
        fabric.load(Path(out) / source, {"model": stage, "optimizer": optimizer})
        assert torch.equal(_tied_exp_avg(stage, optimizer), saved), (rank, source)
    fabric.strategy.forward_backward(stage, ids, targets)
    optimizer.step()
    moved = _tied_exp_avg(stage, optimizer)
    copies = [None] * world_size
    dist.all_gather_object(copies, moved)
    assert torch.equal(copies[0], copies[1])  # the two copies stepped alike
    state = {"model": stage, "optimizer": optimizer}
    fabric.save(Path(out) / "pp2-distributed", state)
    unwrapped = state | {"model": stage._forward_module, "optimizer": optimizer.optimizer}
    checkpoint.save_checkpoint(Path(out) / "pp2-single.pt", unwrapped, distributed=False)

    for source in ("pp2-distributed", "pp2-single.pt"):
        fabric, stage, optimizer = _adamw_run(world_size, 1, config)
        fabric.load(Path(out) / source, {"model": stage, "optimizer": optimizer})
        assert torch.equal(_tied_exp_avg(stage, optimizer), moved), (rank, source)
