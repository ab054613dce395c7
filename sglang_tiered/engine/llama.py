"""A Llama-family decoder run layer by layer with explicit KV in and out (no SGLang).

The per-layer steps are public so that other executors can interleave their own work between them:
  x = model.embed(ids)
  for layer in range(L):
      q, k, v = model.qkv(layer, x, positions)        # RMSNorm, projections, RoPE (k is post-RoPE, like SGLang's pool)
      attn = <any attention over whatever keys the executor holds>
      x = model.finish_layer(layer, x, attn)          # o_proj + residual, RMSNorm, gated MLP + residual
  logits = model.logits(x[-1:])
`prefill` is the single-process reference; chained prefill (KV-Runahead), blending (CacheBlend) and compute-or-load
(Cake, KVPR) reuse the same steps. KV buffers are [layers, tokens, 2 (k, v), kv_heads, head_dim].
Supports Llama checkpoints in Hugging Face layout (safetensors), GQA and MHA, default RoPE (no rope_scaling).

In a reduced dtype (bf16, fp16) the engine rounds as SGLang's Llama does with its native CPU ops: the residual
stream `x` is carried in fp32 (the sum before rounding, which SGLang's fused add + RMSNorm normalises), the residual
is rounded to the model's dtype before each add, and RMSNorm multiplies by its weight in fp32 and rounds once
(Hugging Face's Llama rounds before the weight). So, given the same attention output, a layer's result is SGLang's bit
for bit. In fp32 nothing of this rounds.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from sglang_tiered.kernels.extend_attention import causal_attention
from sglang_tiered.storage.geometry import KVGeometry

# (layer, q [n, Hq, D] or None, k [n, Hkv, D], positions) -> (rotated q or None, rotated k): one call per layer, as
# a server's own kernel rotates a layer's queries and keys together
Rope = Callable[[int, Optional[torch.Tensor], torch.Tensor, torch.Tensor], tuple[Optional[torch.Tensor], torch.Tensor]]


@dataclass(frozen=True)
class LlamaConfig:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = False

    @classmethod
    def from_hf(cls, path: str | Path) -> LlamaConfig:
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))

    @classmethod
    def from_dict(cls, c: dict) -> LlamaConfig:
        """From a Hugging Face config dict (config.json's content). RoPE settings are read from `rope_parameters`
        (transformers >= 5) or the older top-level `rope_theta` / `rope_scaling`."""
        rope = dict(c.get("rope_scaling") or {})
        rope.update(c.get("rope_parameters") or {})
        if rope.get("rope_type", rope.get("type")) not in (None, "default"):
            raise NotImplementedError(f"RoPE {rope} is not supported by the layer-by-layer engine")
        theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
        return cls(hidden=c["hidden_size"], layers=c["num_hidden_layers"], heads=c["num_attention_heads"],
                   kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
                   head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
                   intermediate=c["intermediate_size"], vocab=c["vocab_size"],
                   rope_theta=float(theta), rms_eps=float(c.get("rms_norm_eps", 1e-5)),
                   tie_embeddings=bool(c.get("tie_word_embeddings", False)))

    def geometry(self, itemsize: int) -> KVGeometry:
        return KVGeometry(self.layers, self.kv_heads, self.head_dim, itemsize)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    post_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor

    @property
    def wkv(self) -> torch.Tensor:
        """[W_K; W_V] as one matrix (a view when they are adjacent rows of one fused weight, as in SGLang)."""
        k, v = self.wk, self.wv
        if (k.is_contiguous() and v.is_contiguous() and v.data_ptr() == k.data_ptr() + k.numel() * k.element_size()
                and k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()):
            return k.as_strided((k.shape[0] + v.shape[0], k.shape[1]), k.stride())
        return torch.cat([k, v])


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [vocab], fp32, of the last prompt token
    kv: torch.Tensor  # [layers, tokens, 2, kv_heads, head_dim]


class LlamaModel:
    def __init__(self, cfg: LlamaConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device | str] = None):
        """`device`: where the weights (and every tensor the model makes) live; None: where `weights` are."""
        self.cfg = cfg
        self.dtype = dtype
        w = {k: v.to(device=device or v.device, dtype=dtype) for k, v in weights.items()}
        p = "model."
        self.embed_tokens = w[p + "embed_tokens.weight"]
        self.norm = w[p + "norm.weight"]
        self.lm_head = w.get("lm_head.weight", self.embed_tokens if cfg.tie_embeddings else None)
        if self.lm_head is None:
            raise KeyError("lm_head.weight missing and tie_word_embeddings is false")
        self.layer_weights = [
            LayerWeights(
                input_norm=w[f"{p}layers.{i}.input_layernorm.weight"],
                wq=w[f"{p}layers.{i}.self_attn.q_proj.weight"],
                wk=w[f"{p}layers.{i}.self_attn.k_proj.weight"],
                wv=w[f"{p}layers.{i}.self_attn.v_proj.weight"],
                wo=w[f"{p}layers.{i}.self_attn.o_proj.weight"],
                post_norm=w[f"{p}layers.{i}.post_attention_layernorm.weight"],
                w_gate=w[f"{p}layers.{i}.mlp.gate_proj.weight"],
                w_up=w[f"{p}layers.{i}.mlp.up_proj.weight"],
                w_down=w[f"{p}layers.{i}.mlp.down_proj.weight"],
            )
            for i in range(cfg.layers)
        ]
        half = cfg.head_dim // 2
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, dtype=torch.float32) / half))
        self._rope_table = self._rope_rows(0)  # (cos, sin) [positions, head_dim] fp32, grown on demand

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> LlamaModel:
        from safetensors.torch import load_file

        weights: dict[str, torch.Tensor] = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            weights.update(load_file(str(f)))
        return cls(LlamaConfig.from_hf(path), weights, dtype)

    @classmethod
    def random(cls, cfg: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> LlamaModel:
        """Random weights with sane scales (outputs neither vanish nor explode over the layers), made on `device`
        (the same seed gives other values on another device)."""
        return cls(cfg, random_weights(cfg, seed, device), dtype)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    # ------------------------------------------------------------------ per-layer steps
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The residual stream of tokens `ids` before the first layer: their embeddings, fp32 (see the module
        docstring)."""
        return self.embed_tokens[ids].float()

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate [n, H, D] by absolute `positions` (Hugging Face's rotate-half convention): `rotate` by
        `rope_rows(positions)`."""
        return self.rotate(x, self.rope_rows(positions))

    def rope_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [n, 1, head_dim] (fp32) of `positions`, for `rotate` (a caller rotating the same positions on
        every layer keeps them). They come from a table (the same fp32 values as computing them per call), grown
        here for positions on the CPU; on another device the caller reserves them first (`reserve_positions`:
        reading the largest position back would wait for the device at every layer)."""
        table = self._rope_table  # (one read: a loader thread may swap in a grown table meanwhile)
        if positions.device.type == "cpu" and positions.numel() and int(positions.max()) >= table[0].shape[0]:
            table = self._rope_table = self._rope_rows(int(positions.max()) + 1)
        return table[0][positions][:, None, :], table[1][positions][:, None, :]

    @staticmethod
    def rotate(x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [n, H, D] rotated by `rows` (`rope_rows`), computed in fp32, rounded once to x's dtype."""
        cos, sin = rows
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], -1)
        return (xf * cos + rotated * sin).to(x.dtype)

    def reserve_positions(self, positions: int) -> None:
        """Make `rope` serve positions 0 .. positions - 1 without growing its table (required on a GPU)."""
        if positions > self._rope_table[0].shape[0]:
            self._rope_table = self._rope_rows(positions)

    def _rope_rows(self, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [P, head_dim] for positions 0 .. P - 1, P = the next power of two >= needed (>= 4096)."""
        rows = max(4096, 1 << max(0, needed - 1).bit_length())
        freqs = torch.arange(rows, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = torch.cat([freqs.cos(), freqs.cos()], -1), torch.cat([freqs.sin(), freqs.sin()], -1)
        return cos.to(self.device), sin.to(self.device)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of x (any float dtype) in the model's dtype: normalised and scaled in fp32, rounded once."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_eps)
        return (xf * weight).to(self.dtype)

    def _residual(self, x: torch.Tensor) -> torch.Tensor:
        """The residual SGLang adds to a sublayer's output: the stream rounded to the model's dtype, as fp32."""
        return x.to(self.dtype).float()

    def qkv(self, layer: int, x: torch.Tensor, positions: torch.Tensor, rope: Optional[Rope] = None):
        """Queries [n, Hq, D], keys [n, Hkv, D] (post-RoPE) and values [n, Hkv, D] of tokens at `positions`.
        `rope(layer, q, k, positions)` replaces this engine's rotation (see `kv_from_input`)."""
        w, c = self.layer_weights[layer], self.cfg
        h = self.attention_input(layer, x)
        q = F.linear(h, w.wq).view(-1, c.heads, c.head_dim)
        k = F.linear(h, w.wk).view(-1, c.kv_heads, c.head_dim)
        v = F.linear(h, w.wv).view(-1, c.kv_heads, c.head_dim)
        if rope is not None:
            q, k = rope(layer, q, k, positions)
            return q, k, v
        return self.rope(q, positions), self.rope(k, positions), v

    def attention_input(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The layer's attention input: the residual stream after its input RMSNorm (what KVPR stores)."""
        return self._rms(x, self.layer_weights[layer].input_norm)

    def kv_from_input(self, layer: int, h: torch.Tensor, positions: torch.Tensor, rope: Optional[Rope] = None):
        """Keys [n, Hkv, D] (post-RoPE) and values of tokens at `positions` from their attention input `h`
        [n, hidden] (`attention_input`): compute-or-load's K = X W_K, V = X W_V. `rope(layer, None, k,
        positions)` replaces this engine's rotation (a server passes its own kernel, so that the recomputed keys
        are bit-identical to the ones it stored)."""
        w, c = self.layer_weights[layer], self.cfg
        kv = F.linear(h, w.wkv).view(-1, 2, c.kv_heads, c.head_dim)
        k = kv[:, 0].contiguous()
        return (self.rope(k, positions) if rope is None else rope(layer, None, k, positions)[1]), kv[:, 1]

    def finish_layer(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual stream (fp32) after the layer, given the attention output [n, Hq, D] of its tokens."""
        w = self.layer_weights[layer]
        x = F.linear(attn.reshape(attn.shape[0], -1), w.wo).float() + self._residual(x)
        h = self._rms(x, w.post_norm)
        return F.linear(F.silu(F.linear(h, w.w_gate)) * F.linear(h, w.w_up), w.w_down).float() + self._residual(x)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The last RMSNorm: what a serving engine's logits processor expects as the model's output."""
        return self._rms(x, self.norm)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.final_norm(x), self.lm_head).float()

    def empty_kv(self, tokens: int) -> torch.Tensor:
        c = self.cfg
        return torch.empty(c.layers, tokens, 2, c.kv_heads, c.head_dim, dtype=self.dtype, device=self.device)

    # ------------------------------------------------------------------ reference
    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, kv: Optional[torch.Tensor] = None) -> PrefillResult:
        """Single-process prefill of a whole prompt: last-token logits and the full KV."""
        n = ids.shape[0]
        self.reserve_positions(n)
        kv = self.empty_kv(n) if kv is None else kv
        positions = torch.arange(n, device=self.device)
        ids = ids.to(self.device)
        x = self.embed(ids)
        for layer in range(self.cfg.layers):
            q, k, v = self.qkv(layer, x, positions)
            kv[layer, :, 0], kv[layer, :, 1] = k, v
            x = self.finish_layer(layer, x, causal_attention(q, kv[layer, :, 0], kv[layer, :, 1], 0))
        return PrefillResult(self.logits(x[-1:])[0], kv)

    @torch.inference_mode()
    def chunk_kv(self, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each chunk's own KV [layers, len, 2, kv_heads, head_dim] -- what `prefill(chunk).kv` gives (positions
        from 0, attending to itself only) -- in one pass: the linears run on every chunk's tokens at once, the
        attention chunk by chunk, and nothing past the last layer's K, V (no MLP there, no logits). Views of one
        buffer. The same values as one prefill per chunk up to the float rounding of the wider products; for
        many short chunks it is several times faster (100 six-token chunks of SmolLM2: one pass instead of 100)."""
        lengths = [int(c.shape[0]) for c in chunks]
        if not lengths or min(lengths) < 1:
            raise ValueError(f"chunk_kv needs one or more non-empty chunks, got lengths {lengths}")
        self.reserve_positions(max(lengths))
        ends = torch.tensor(lengths).cumsum(0).tolist()
        bounds = list(zip([0, *ends[:-1]], ends))
        kv = self.empty_kv(ends[-1])
        positions = torch.cat([torch.arange(n) for n in lengths]).to(self.device)
        x = self.embed(torch.cat([c.reshape(-1) for c in chunks]).to(self.device))
        for layer in range(self.cfg.layers):
            q, k, v = self.qkv(layer, x, positions)
            kv[layer, :, 0], kv[layer, :, 1] = k, v
            if layer + 1 < self.cfg.layers:
                attn = torch.cat([causal_attention(q[a:b], k[a:b], v[a:b], 0) for a, b in bounds])
                x = self.finish_layer(layer, x, attn)
        return [kv[:, a:b] for a, b in bounds]


def random_weights(cfg: LlamaConfig, seed: int = 0, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Hugging Face-named random weights of a Llama model with sane scales (fp32), made on `device`."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device)

    def rnd(*shape, fan_in):
        return randn(*shape) / fan_in**0.5

    h, d = cfg.hidden, cfg.head_dim
    w = {"model.embed_tokens.weight": randn(cfg.vocab, h),
         "model.norm.weight": torch.ones(h, device=device), "lm_head.weight": rnd(cfg.vocab, h, fan_in=h)}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        w.update({
            p + "input_layernorm.weight": 1 + 0.1 * randn(h),
            p + "post_attention_layernorm.weight": 1 + 0.1 * randn(h),
            p + "self_attn.q_proj.weight": rnd(cfg.heads * d, h, fan_in=h),
            p + "self_attn.k_proj.weight": rnd(cfg.kv_heads * d, h, fan_in=h),
            p + "self_attn.v_proj.weight": rnd(cfg.kv_heads * d, h, fan_in=h),
            p + "self_attn.o_proj.weight": rnd(h, cfg.heads * d, fan_in=cfg.heads * d),
            p + "mlp.gate_proj.weight": rnd(cfg.intermediate, h, fan_in=h),
            p + "mlp.up_proj.weight": rnd(cfg.intermediate, h, fan_in=h),
            p + "mlp.down_proj.weight": rnd(h, cfg.intermediate, fan_in=cfg.intermediate),
        })
    return w


def save_config(path: str | Path, cfg: LlamaConfig, dtype: str = "float32") -> Path:
    """`path`/config.json of a Hugging Face Llama with `cfg`'s shape (a `--load-format dummy` server needs no more,
    but a tokenizer). Returns `path`."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.hidden,
              "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads,
              "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate, "vocab_size": cfg.vocab,
              "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_eps, "tie_word_embeddings": cfg.tie_embeddings,
              "max_position_embeddings": 32768, "hidden_act": "silu", "torch_dtype": dtype}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def save_random_checkpoint(path: str | Path, cfg: LlamaConfig, seed: int = 0) -> Path:
    """A Hugging Face-layout Llama checkpoint with random weights (config.json + model.safetensors, fp32), loadable by
    `LlamaModel.from_pretrained` and by SGLang; the tokenizer is not included."""
    from safetensors.torch import save_file

    out = save_config(path, cfg)
    weights = random_weights(cfg, seed)
    if cfg.tie_embeddings:
        weights.pop("lm_head.weight")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    return out
