"""What one pipeline stage computes for one subsequence: its layers, plus the loss on the last stage."""

from __future__ import annotations

from torch import Tensor, nn

from lightning_sppo.documents import Documents
from lightning_sppo.loss import chunked_cross_entropy
from lightning_sppo.model.gpt import GPT

__all__ = ["StageModule"]


class StageModule(nn.Module):
    """A (possibly cut) GPT whose ``forward`` returns hidden states, or on the last stage the loss share.

    Wrapping the loss in a module's ``forward`` matters under FSDP2: its hooks run around ``forward``, and
    the head weight is used by the chunked loss, not by ``lm_head.forward``.
    """

    def __init__(self, model: GPT, loss_chunk_tokens: int | None = None) -> None:
        super().__init__()
        self.model = model
        self.loss_chunk_tokens = loss_chunk_tokens

    @property
    def is_last(self) -> bool:
        return self.model.lm_head is not None

    @property
    def is_first(self) -> bool:
        return self.model.wte is not None

    def forward(
        self,
        x: Tensor,
        offset: int,
        targets: Tensor | None = None,
        normalizer: Tensor | None = None,
        documents: Documents | None = None,
    ) -> Tensor:
        """x: token ids [B, s] (first stage) or hidden states [B, s, D]; returns [B, s, D] or a scalar loss
        share: sum of the cross-entropy over the valid targets of these tokens / ``normalizer``. ``documents``:
        the packed documents of the whole (micro-)batch these tokens belong to, or None."""
        hidden = self.model.hidden_states(x, offset, documents)
        if not self.is_last:
            return hidden
        return chunked_cross_entropy(hidden, self.model.lm_head.weight, targets, normalizer, self.loss_chunk_tokens)
