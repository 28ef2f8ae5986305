"""Pipeline stages: which layers each stage owns, and cutting a plain GPT down to one stage."""

from __future__ import annotations

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.model.gpt import GPT

__all__ = ["layers_per_stage", "split_stage", "stage_costs"]


def stage_costs(config: GPTConfig) -> tuple[float, float, float]:
    """Per-token matmul FLOPs of (one block, the embedding, the final norm + head + loss), up to a constant.

    The embedding is a lookup (~0); the head multiplies by a [V, D] matrix, which for small models weighs
    as much as several blocks, so the last stage gets fewer layers.
    """
    d, hs = config.n_embd, config.head_size
    attn = d * (config.n_head + 2 * config.n_query_groups) * hs + config.n_head * hs * d
    mlp = (3 if config.mlp == "swiglu" else 2) * d * config.intermediate_size
    return float(attn + mlp), 0.0, float(config.vocab_size * d)


def layers_per_stage(config: GPTConfig, pp: int, override: list[int] | None = None) -> list[int]:
    """Layers of each stage: ``override`` if given (checked), else contiguous runs balanced by compute.

    Minimises the most expensive stage, counting the embedding on the first and the head on the last.
    """
    if override is not None:
        if len(override) != pp or sum(override) != config.n_layer or min(override) < 1:
            raise ValueError(
                f"layers_per_stage={override} must list {pp} positive layer counts (one per pipeline stage)"
                f" summing to n_layer={config.n_layer}, e.g. {_balanced(config, pp)}."
            )
        return list(override)
    if config.n_layer < pp:
        raise ValueError(
            f"The model has n_layer={config.n_layer} layers, fewer than pipeline_parallel={pp} stages;"
            f" use pipeline_parallel<={config.n_layer}."
        )
    return _balanced(config, pp)


def _balanced(config: GPTConfig, pp: int) -> list[int]:
    block, embed, head = stage_costs(config)
    L = config.n_layer
    # best[k][n]: the smallest possible max-stage-cost putting the first n layers on stages 0..k-1.
    inf = float("inf")
    best = [[inf] * (L + 1) for _ in range(pp + 1)]
    choice = [[0] * (L + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for k in range(1, pp + 1):
        for n in range(k, L - (pp - k) + 1):
            for m in range(k - 1, n):  # stage k-1 takes layers m..n-1
                cost = (n - m) * block + (embed if k == 1 else 0.0) + (head if k == pp else 0.0)
                value = max(best[k - 1][m], cost)
                if value < best[k][n]:
                    best[k][n], choice[k][n] = value, m
    counts, n = [], L
    for k in range(pp, 0, -1):
        m = choice[k][n]
        counts.append(n - m)
        n = m
    return counts[::-1]


def split_stage(model: GPT, stage: int, counts: list[int]) -> GPT:
    """Cut ``model`` in place down to pipeline stage ``stage``: its layers, plus the embedding on the first
    stage and the final norm and head on the last. Kept parameters keep the plain model's names."""
    start = sum(counts[:stage])
    owned = {str(i) for i in range(start, start + counts[stage])}
    for name in [name for name in model.blocks if name not in owned]:
        del model.blocks[name]
    if stage > 0:
        model.wte = None
    if stage < len(counts) - 1:
        model.norm_f = None
        model.lm_head = None
    return model
