"""Hooked decoder-only transformers whose attention normalisation is a choice.

:class:`HookedNormTransformer` (its config and building blocks live in two other files, see below).
Hook names and weight shapes follow TransformerLens's HookedTransformer
(``blocks.{l}.attn.hook_q``, ``W_Q`` shaped ``[n_heads, d_model, d_head]``), so
``transformer_lens.patching`` and ``ActivationCache`` work on these models unchanged. Where TL would
fail silently or vaguely on them (wrong hook names, hooks that never fire, the final norm, logit
attribution through the MLP head), :mod:`interp_norm.core.tl_api` refuses with a typed error or corrects it.

Attention normalisation (``ModelConfig.attn_norm``), after Menary et al. (2024), formulation table:

=========  ===============================================  ==================================
``pre``    w = N(x)ᵀ W_QK N(y),  v = W_V N(y)               the paper's Pre-Norm baseline
``qkv``    w = N(W_Q x)ᵀ N(W_K y),  v = N(W_V y)            the paper's QKV-Norm (per head)
``qk``     w = N(W_Q x)ᵀ N(W_K y),  v = W_V y               QK-Norm (Qwen3, Gemma 3, OLMo 2)
``none``   w = xᵀ W_QK y,  v = W_V y                        No-Norm
=========  ===============================================  ==================================

The architecture is split in three files read in this order: :mod:`interp_norm.core.config`
(``ModelConfig`` and every choice the paper leaves open), :mod:`interp_norm.core.components` (norms,
calibration, embeddings, attention, MLP, block, output head: nanoGPT-style, top to bottom) and this
module (the model: embedding, blocks, head, tokens, TransformerLens conveniences).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Iterator, Literal, Optional, Sequence

import einops
import torch
import torch.nn as nn
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens import ActivationCache
from transformer_lens.FactoredMatrix import FactoredMatrix
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule

from interp_norm.core import task as T
from interp_norm.errors import ConfigError, ProblemStringError
from interp_norm.core.defaults import ATTN_NORMS
from interp_norm.core.components import (
    MLP, Attention, Calibration, HeadNorm, Norm, OutputHead, SinusoidalPosEmbed, TransformerBlock, fitting_calibration,
)
from interp_norm.core.config import CALIBRATIONS, NORM_KINDS, ModelConfig
from interp_norm.core.tl_api import DLA_REFUSAL, NormActivationCache, check_hooks, check_names_filter, dormant_hooks


# ----------------------------------------------------------------------------- the model


class HookedNormTransformer(HookedRootModule):
    """Decoder-only transformer for the addition task, hooked like TransformerLens's HookedTransformer.

    ``forward(tokens)`` returns logits ``[batch, pos, d_vocab]``; ``return_type="loss"`` gives the
    paper's masked cross-entropy over answer tokens (see :func:`interp_norm.core.task.answer_mask`).

    ``task`` is the :class:`~interp_norm.core.task.AdditionTask` the model is (to be) trained on: models
    loaded from a checkpoint or returned by ``train`` carry theirs, and every analysis that needs a
    task defaults to it (:func:`interp_norm.core.task.task_for`). ``name`` is what messages call the
    model (the pretrained name or checkpoint folder it was loaded from).
    """

    # an nn.ModuleList, typed by what it holds (ModuleList is not generic); a buffer
    blocks: list[TransformerBlock]
    calibrated: Tensor

    def __init__(self, cfg: ModelConfig, task: Optional[T.AdditionTask] = None, name: Optional[str] = None):
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise ConfigError(f"HookedNormTransformer needs a ModelConfig, got {type(cfg).__name__}")
        if task is not None and not isinstance(task, T.AdditionTask):
            raise ConfigError(f"task must be an AdditionTask (or None), got {type(task).__name__}")
        self.cfg = cfg
        self.task: Optional[T.AdditionTask] = task
        self.name: Optional[str] = name
        self.W_E = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model))
        if cfg.pos_embed == "learned":
            self.W_pos = nn.Parameter(torch.empty(cfg.n_ctx, cfg.d_model))
        else:
            self.pos_embed = SinusoidalPosEmbed(cfg)
        self.hook_embed, self.hook_pos_embed = HookPoint(), HookPoint()
        self.blocks = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))  # type: ignore[assignment]
        self.ln_final = Norm(cfg.d_model, "ln", cfg.eps, bias=True)
        self.head = OutputHead(cfg)
        if cfg.calibration == "paper":
            self.calib_type = Calibration(cfg.calib_type_std)
            self.calib_embed = Calibration(cfg.calib_embed_std)
            self.register_buffer("calibrated", torch.zeros((), dtype=torch.bool))
        self._init_weights()
        self.setup()

    # -- init ----------------------------------------------------------------------------------
    @torch.no_grad()
    def _init_weights(self) -> None:
        """Seeded init giving every variant comparable activation sizes at step 0.

        Token embeddings have std ``init_embed_std`` (|x_type| ≈ |x_pos| for the defaults);
        W_Q/W_K/W_V have std 1/√d_model so q entries are O(1) after a norm; W_O and the MLP's
        W_out are scaled by 1/√(2·n_layers) as in GPT-2 so the residual stream grows slowly.
        """
        cfg = self.cfg
        g = torch.Generator().manual_seed(cfg.seed)

        def normal_(p: Tensor, std: float) -> None:
            p.copy_(torch.randn(p.shape, generator=g) * std)

        normal_(self.W_E, cfg.init_embed_std)
        if cfg.pos_embed == "learned":
            normal_(self.W_pos, cfg.init_embed_std)
        depth = 1 / math.sqrt(2 * cfg.n_layers)
        for block in self.blocks:
            a = block.attn
            for W in (a.W_Q, a.W_K, a.W_V):
                normal_(W, 1 / math.sqrt(cfg.d_model))
            normal_(a.W_O, depth / math.sqrt(cfg.n_heads * cfg.d_head))
            normal_(block.mlp.W_in, 1 / math.sqrt(cfg.d_model))
            normal_(block.mlp.W_out, depth / math.sqrt(block.mlp.W_out.shape[0]))  # d_mlp
        if cfg.head == "unembed":
            normal_(self.head.W_U, 1 / math.sqrt(cfg.d_model))
        else:
            for layer in self.head.layers:
                normal_(layer.weight, 1 / math.sqrt(layer.in_features))
                layer.bias.zero_()

    # -- forward -------------------------------------------------------------------------------
    def embed(self, tokens: Int[Tensor, "batch pos"], pos_offset: Optional[Tensor] = None) -> Float[Tensor, "batch pos d_model"]:
        cfg = self.cfg
        b, n = tokens.shape
        if n > cfg.n_ctx:
            raise ProblemStringError(
                f"the input has {n} tokens but the model's context is n_ctx={cfg.n_ctx}; "
                "use shorter problems or a model with a larger n_ctx"
            )
        if tokens.dtype not in (torch.long, torch.int32, torch.int64):
            raise ProblemStringError(f"tokens must be an integer tensor, got {tokens.dtype}; use model.to_tokens(...)")
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= cfg.d_vocab):
            raise ProblemStringError(f"token ids must lie in [0, {cfg.d_vocab}); use model.to_tokens(...)")
        tok = self.W_E[tokens]
        if cfg.pos_embed == "learned":
            pos = einops.repeat(self.W_pos[:n], "p d -> b p d", b=b)
        else:
            positions = torch.arange(n, device=tokens.device).expand(b, n)
            if pos_offset is not None:
                positions = positions + pos_offset.view(b, 1).to(tokens.device)
            pos = self.pos_embed(positions)
        if cfg.calibration == "paper":  # x = (c_type·x_type + x_pos)·c_embed, split so resid = embed + pos
            tok = self.calib_type(tok)
            tok, pos = self.calib_embed(tok, measure=tok + pos), self.calib_embed(pos, measure=tok + pos)
        return self.hook_embed(tok) + self.hook_pos_embed(pos)

    # -- the paper's Checkpoint calibration -------------------------------------------------------
    @property
    def is_calibrated(self) -> bool:
        """True for models without Checkpoint layers, and for those whose factors have been fitted."""
        return self.cfg.calibration == "none" or bool(self.calibrated)

    @torch.no_grad()
    def calibrate(self, tokens: Int[Tensor, "batch pos"], pos_offset: Optional[Int[Tensor, " batch"]] = None) -> None:
        """Fit every Checkpoint factor on this batch (in forward order), then freeze them."""
        if self.cfg.calibration == "none":
            raise ConfigError("this model has no Checkpoint layers to calibrate; build it with calibration='paper'")
        with fitting_calibration(tokens.to(self.W_E.device) != T.PAD_ID):
            self(tokens, pos_offset=pos_offset)
        self.calibrated.fill_(True)

    def calibration_factors(self) -> dict[str, float]:
        """Every Checkpoint factor by module name (empty for models without them)."""
        return {n: float(m.factor) for n, m in self.named_modules() if isinstance(m, Calibration)}

    def forward(
        self,
        input: Int[Tensor, "batch pos"] | Float[Tensor, "batch pos d_model"] | str | Sequence[str],
        return_type: Optional[Literal["logits", "loss", "both"]] = "logits",
        pos_offset: Optional[Int[Tensor, " batch"]] = None,
        *,
        start_at_layer: Optional[int] = None,
        stop_at_layer: Optional[int] = None,
        tokens: Optional[Int[Tensor, "batch pos"]] = None,
        loss_per_token: bool = False,
    ) -> Any:
        """Logits; or the masked answer-token loss; or both. ``pos_offset`` shifts positions per row.

        As HookedTransformer's: with ``start_at_layer=l``, ``input`` is the residual stream entering
        ``blocks[l]`` (pass ``tokens=`` for a loss); with ``stop_at_layer=l`` the residual entering
        ``blocks[l]`` is returned instead of logits. ``loss_per_token=True`` returns the loss at every
        position ([batch, pos], zero where nothing is scored) instead of the mean.
        """
        if start_at_layer is None:
            tokens = input if isinstance(input, Tensor) else self.to_tokens(input)
            if tokens.ndim == 1:
                tokens = tokens.unsqueeze(0)
            tokens = tokens.to(self.W_E.device)
            resid = self.embed(tokens, pos_offset)
        else:
            if not isinstance(input, Tensor) or input.ndim != 3 or input.shape[-1] != self.cfg.d_model:
                raise ConfigError(f"with start_at_layer, input must be the residual stream [batch, pos, {self.cfg.d_model}]")
            resid = input
        for block in self.blocks[start_at_layer:stop_at_layer]:
            resid = block(resid)
        if stop_at_layer is not None:
            return resid
        logits = self.head(self.ln_final(resid))
        if return_type in (None, "logits"):
            return logits if return_type == "logits" else None
        if tokens is None:
            raise ConfigError("a loss needs the tokens: pass tokens= when starting from a residual (start_at_layer)")
        targets = T.next_token_targets(tokens)
        if loss_per_token:
            loss = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="none")
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        return loss if return_type == "loss" else (logits, loss)

    @classmethod
    def from_pretrained(cls, name: str, device: str | torch.device = "cpu", **tl_options: Any) -> "HookedNormTransformer":
        """A shipped checkpoint by name (``"pre"``, ``"qkv"`` ...; see ``interp-norm list``) or a checkpoint folder.

        TransformerLens's entry point; the same model as ``interp_norm.load(name)``, in eval mode,
        carrying its training task as ``model.task`` (analyses default to it). TL's weight-processing
        options (``fold_ln`` ...) do not apply: weights load as trained. Hugging Face models load with
        ``interp_norm.load`` (a TransformerLens bridge, not this class).
        """
        if tl_options:
            raise ConfigError(f"from_pretrained loads weights as trained; TransformerLens options {sorted(tl_options)} are not supported")
        # Users look for the loader on the class, as in TL. Checkpoints are read one layer up (that
        # module builds models from this one), so this calls the package's public, lazily loaded
        # ``interp_norm.load`` at call time instead of importing the layers above here.
        import interp_norm

        return interp_norm.load(name, device=device, kind="interp_norm")

    # -- hooks: TransformerLens's API, refusing names that do not exist or never fire ---------------
    def run_with_cache(self, *args: Any, **kwargs: Any) -> tuple[Any, NormActivationCache]:
        """As HookedRootModule's; the cache is an ``ActivationCache`` that knows these models' norms."""
        out, cache = super().run_with_cache(*args, **kwargs)
        if isinstance(cache, ActivationCache):
            cache = cache.cache_dict
        return out, NormActivationCache(cache, self, has_batch_dim=not kwargs.get("remove_batch_dim", False))

    def get_caching_hooks(self, names_filter: Any = None, *args: Any, **kwargs: Any) -> tuple[dict, list, list]:
        """TL's, but listed names must exist and fire (:class:`HookNameError`), and points that never fire are skipped."""
        check_names_filter(self, names_filter)
        cache, fwd, bwd = super().get_caching_hooks(names_filter, *args, **kwargs)
        dormant = dormant_hooks(self)
        return cache, [h for h in fwd if h[0] not in dormant], [h for h in bwd if h[0] not in dormant]

    @contextmanager
    def hooks(self, fwd_hooks: Sequence = (), bwd_hooks: Sequence = (), reset_hooks_end: bool = True, clear_contexts: bool = False) -> Iterator["HookedNormTransformer"]:
        """TL's ``hooks`` context manager (behind ``run_with_hooks`` and ``run_with_cache``); every hook
        name is checked before any hook is added (:func:`interp_norm.core.tl_api.check_hooks`)."""
        fwd_hooks, bwd_hooks = list(fwd_hooks), list(bwd_hooks)
        check_hooks(self, fwd_hooks + bwd_hooks)
        with super().hooks(fwd_hooks, bwd_hooks, reset_hooks_end, clear_contexts) as model:
            yield model

    def add_hook(self, name: Any, hook: Any, *args: Any, **kwargs: Any) -> None:
        """TL's ``add_hook``, with the same name checks as :meth:`hooks`."""
        check_hooks(self, [(name, hook)])
        super().add_hook(name, hook, *args, **kwargs)

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """Fire ``hook_result`` (per-head outputs); as HookedTransformer's. Same weights, same function
        up to float rounding (the per-head sum is taken after W_O)."""
        self.cfg.use_attn_result = bool(use_attn_result)

    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """Fire ``hook_q_input/k_input/v_input`` (one residual copy per head); as HookedTransformer's."""
        self.cfg.use_split_qkv_input = bool(use_split_qkv_input)

    # -- tokens --------------------------------------------------------------------------------
    def to_tokens(self, problems: str | Sequence[str], prepend_bos: bool = True, **_: Any) -> Int[Tensor, "batch pos"]:
        """Problem strings → right-padded token ids. Each string is validated by the task parser."""
        if isinstance(problems, str):
            problems = [problems]
        if len(problems) == 0:
            raise ProblemStringError("no problems given; pass a string like '[12+N7=' or a list of them")
        seqs = []
        for s in problems:
            p = T.parse_problem(s)
            text = s.strip()
            if prepend_bos and not text.startswith(T.BOS):
                text = T.BOS + text
            # keep whatever answer part the user wrote (already checked against the arithmetic)
            seqs.append(T.encode(text if T.EQ in text else p.question))
        tokens = T.pad_batch(seqs)
        self._check_fits(tokens.shape[1])
        return tokens.to(self.W_E.device)

    def _check_fits(self, n: int) -> None:
        if n > self.cfg.n_ctx:
            raise ProblemStringError(
                f"a problem is {n} tokens long but the model's context is n_ctx={self.cfg.n_ctx}; "
                "use fewer terms/digits or a model with a larger n_ctx"
            )

    def to_single_token(self, string: str) -> int:
        """The token id of a one-character string (every token is one character), as TL's."""
        if not isinstance(string, str) or string not in T.TOKEN_TO_ID:
            raise ProblemStringError(f"{string!r} is not a single token; the tokens are the characters {''.join(T.VOCAB)!r}")
        return T.TOKEN_TO_ID[string]

    def to_string(self, tokens: Int[Tensor, "... pos"]) -> str | list[str]:
        if tokens.ndim == 1:
            return T.decode(tokens)
        return [T.decode(t) for t in tokens]

    def to_str_tokens(self, tokens: Int[Tensor, " pos"] | str) -> list[str]:
        if isinstance(tokens, str):
            tokens = self.to_tokens(tokens)[0]
        if tokens.ndim == 2:
            tokens = tokens[0]
        return [T.VOCAB[int(i)] for i in tokens]

    @torch.no_grad()
    def generate(self, problems: str | Sequence[str] | Int[Tensor, "batch pos"], max_new_tokens: Optional[int] = None,
                 *, warn_out_of_distribution: bool = True) -> list[str]:
        """Greedy answers: for ``"[12+N7="`` returns ``"5]"``. Stops at ``]`` (kept in the output).

        Problems outside the training split of ``self.task`` (more or fewer terms, other term
        lengths) are answered, with an :class:`~interp_norm.errors.OutOfDistributionWarning` saying
        what is out of distribution (``warn_out_of_distribution=False`` for deliberate OOD tests).
        """
        if isinstance(problems, Tensor):
            tokens = problems.clone()
            parsed = []
            if warn_out_of_distribution and self.task is not None:
                for row in tokens.reshape(-1, tokens.shape[-1]):
                    try:
                        parsed.append(T.parse_problem(T.decode(row)))
                    except ProblemStringError:
                        pass  # not a problem string: nothing to compare with the training split
        else:
            if isinstance(problems, str):
                problems = [problems]
            if len(problems) == 0:
                raise ProblemStringError("no problems given; pass a string like '[12+N7=' or a list of them")
            parsed = [T.parse_problem(s) for s in problems]
            tokens = T.pad_batch([T.encode(p.question) for p in parsed])
        if warn_out_of_distribution:
            T.warn_out_of_distribution(self, parsed, stacklevel=4)  # past torch.no_grad's wrapper, to the caller
        tokens = tokens.to(self.W_E.device)
        lengths = (tokens != T.PAD_ID).sum(-1)
        longest = int(lengths.max())
        self._check_fits(longest)
        if longest >= self.cfg.n_ctx:
            raise ProblemStringError(
                f"a problem is {longest} tokens long and fills the model's context n_ctx={self.cfg.n_ctx}, "
                "leaving no room for an answer; use fewer terms/digits or a model with a larger n_ctx"
            )
        budget = max_new_tokens if max_new_tokens is not None else self.cfg.n_ctx - int(lengths.min())
        width = min(self.cfg.n_ctx, int(lengths.max()) + budget)
        if width > tokens.shape[1]:
            tokens = F.pad(tokens, (0, width - tokens.shape[1]), value=T.PAD_ID)
        start = lengths.clone()
        done = torch.zeros(len(tokens), dtype=torch.bool, device=tokens.device)
        rows = torch.arange(len(tokens), device=tokens.device)
        for _ in range(budget):
            active = ~done & (lengths < width)
            if not active.any():
                break
            n = int(lengths[active].max())
            logits = self(tokens[:, :n])
            nxt = logits[rows, (lengths - 1).clamp(max=n - 1)].argmax(-1)
            idx = rows[active]
            tokens[idx, lengths[idx]] = nxt[idx]
            lengths[idx] += 1
            done |= active & (nxt == T.EOS_ID)
        return [T.decode(tokens[i, start[i] : lengths[i]]) for i in range(len(tokens))]

    # -- conveniences ----------------------------------------------------------------------------
    @property
    def W_pos_embed(self) -> Tensor:
        """Positional embeddings of positions 0..n_ctx-1 at offset 0: [n_ctx, d_model]."""
        if self.cfg.pos_embed == "learned":
            return self.W_pos
        return self.pos_embed(torch.arange(self.cfg.n_ctx, device=self.W_E.device).unsqueeze(0))[0]

    @property
    def W_U(self) -> Tensor:
        """[d_model, d_vocab] for ``head='unembed'``. A :class:`ConfigError` (a ValueError, so ``hasattr``
        does not swallow it) for the paper's MLP head, which has no single unembedding."""
        if self.cfg.head != "unembed":
            raise ConfigError("this model has the paper's MLP output head, not a plain unembedding W_U; build it with head='unembed'")
        return self.head.W_U

    def tokens_to_residual_directions(self, tokens: str | int | Tensor) -> Tensor:
        """The residual direction each token's logit reads (``[..., d_model]``), as TL's, for ``head='unembed'``.

        ``ln_final``'s gain is folded in (W_U scaled row-wise), as TL's default ``fold_ln`` does, so
        ``cache.logit_attrs`` dotted with the centred, scaled residual gives logit - b_U - b_ln·W_U.
        The MLP head has no such direction: :class:`ConfigError` saying what to use instead.
        """
        if self.cfg.head != "unembed":
            raise ConfigError(DLA_REFUSAL)
        W = self.ln_final.w[:, None] * self.head.W_U
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        if isinstance(tokens, Tensor) and tokens.numel() > 1:
            return einops.rearrange(W[:, tokens], "d ... -> ... d")
        return W[:, int(tokens)]

    def _stack(self, name: str) -> Tensor:
        return torch.stack([getattr(b.attn, name) for b in self.blocks])

    W_Q = property(lambda self: self._stack("W_Q"), doc="[n_layers, n_heads, d_model, d_head]")
    W_K = property(lambda self: self._stack("W_K"), doc="[n_layers, n_heads, d_model, d_head]")
    W_V = property(lambda self: self._stack("W_V"), doc="[n_layers, n_heads, d_model, d_head]")
    W_O = property(lambda self: self._stack("W_O"), doc="[n_layers, n_heads, d_head, d_model]")

    @property
    def QK(self) -> FactoredMatrix:
        """W_Q W_Kᵀ per head, a TL ``FactoredMatrix`` [n_layers, n_heads, d_model, d_model] (row-vector
        convention: score ∝ x_q QK x_kᵀ), built from the raw weights as in an unfolded HookedTransformer.

        What it means, by variant (``attn_scale`` and the paper's calibration factors always excluded):
        No-Norm scores are x_q QK x_kᵀ / attn_scale. Pre-Norm: QK acts on ln1's output, the normalised
        residual times its query/key gains, which are *not* folded in (scores = (N(x_q)·g_q) QK
        (N(x_k)·g_k)ᵀ / attn_scale; scale W_Q/W_K's rows by ``blocks[l].ln1.w`` to fold them).
        QK/QKV-Norm: the per-head q and k norms act *between* W_Q and W_K, so QK is the bilinear form
        before those norms (hook_q · hook_k), not the one the scores use.
        """
        return FactoredMatrix(self.W_Q, self.W_K.transpose(-2, -1))

    @property
    def OV(self) -> FactoredMatrix:
        """W_V W_O per head, a TL ``FactoredMatrix`` [n_layers, n_heads, d_model, d_model] (x @ OV).

        Raw weights as in :attr:`QK`: Pre-Norm applies it to ln1's output (value gain not folded in),
        QKV-Norm's per-head v norm acts between W_V and W_O; b_O is excluded, as in TL.
        """
        return FactoredMatrix(self.W_V, self.W_O)

    def hook_names(self) -> list[str]:
        return list(self.hook_dict)


# The building blocks and the config are importable from here too (``from interp_norm.core.model import Norm``).
__all__ = [
    "ModelConfig", "HookedNormTransformer", "ATTN_NORMS", "NORM_KINDS", "CALIBRATIONS",
    "Norm", "HeadNorm", "Calibration", "SinusoidalPosEmbed", "Attention", "MLP", "TransformerBlock", "OutputHead",
]
