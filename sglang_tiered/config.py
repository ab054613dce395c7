"""Every `--tiered-*` option in one dataclass: CLI flag <-> field <-> JSON, validated once at startup.

Sizes are bytes; `parse_size` accepts suffixes (K, M, G, T = powers of 1024; KB, MB, GB, TB = powers of 1000).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Optional

from sglang_tiered.policy.importance import GATES
from sglang_tiered.policy.loading import DEFAULT_RATIO, POSITION_TOKENS

CPU_ATTENTION_CHOICES = ("prefix_aware", "torch_native")  # --tiered-cpu-attention
BLEND_CHOICES = ("off", "full", "prefix", "reuse", "single", "blend")  # --tiered-blend (see engine/blend.py)
BLEND_SELECT_CHOICES = ("deviation", "importance", "position")  # --tiered-blend-select (see engine/blend.py)
IMPORTANCE_LOAD_CHOICES = ("off", "gated")  # --tiered-importance-load (see engine/sparse.py)
IMPORTANCE_GATE_CHOICES = GATES  # --tiered-importance-gate (see engine/sparse.py)
PROBE_BITS_CHOICES = (4, 8)  # --tiered-importance-probe-bits (see storage/group_file.py)
KVPR_CHOICES = ("off", "auto", "force")  # --tiered-kvpr (see policy/kvpr.py, engine/meet.py)
CHOICES = {"cpu_attention": CPU_ATTENTION_CHOICES, "blend": BLEND_CHOICES, "blend_select": BLEND_SELECT_CHOICES,
           "importance_load": IMPORTANCE_LOAD_CHOICES,
           "importance_probe_bits": PROBE_BITS_CHOICES, "importance_gate": IMPORTANCE_GATE_CHOICES,
           "kvpr": KVPR_CHOICES}
DEFAULT_PAGE_SIZE = 64  # tokens; SGLang's default (1) makes one file per token, which is slower than recompute
_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
          "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4}


class ConfigError(ValueError):
    """A bad option value; the message starts with the flag's name."""


def parse_size(text: str | int) -> int:
    """'512M' -> 536870912. Raises ValueError on anything that is not a non-negative size."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"not a size: {text!r} (use bytes or a suffix such as 512M, 20G)")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value < 0:
        raise ValueError(f"size must be non-negative: {text!r}")
    return value


def flag_size(field: str, text: str | int) -> int:
    """`parse_size` of the value of flag `--tiered-<field>`; raises ConfigError naming the flag."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise ConfigError(f"--tiered-{field.replace('_', '-')}: {exc}") from None


def default_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sglang-tiered"


@dataclass
class TieredConfig:
    """Options of the tiered backend. Field `x_y` is flag `--tiered-x-y` (see FLAG_HELP)."""

    ssd_dir: str = str(default_cache_root() / "ssd")
    ssd_capacity: int = 16 * 1024**3  # bytes, this server's pages summed over its TP ranks
    host_size: str = ""  # "" (SGLang's default ratio), "<n>x" (ratio to the device pool) or whole GiB ("4G")
    namespace: str = ""  # salt mixed into every page key's namespace
    prefetch_threshold: int = 0  # tokens; 0 = one page: any full page on SSD is worth loading
    io_threads: int = 4  # parallel file reads/writes per rank
    stats_interval: float = 10.0  # seconds between stats log lines (0 = off)
    cpu_attention: str = "prefix_aware"  # without CUDA: "prefix_aware" (ours) or "torch_native" (SGLang's)
    blend: str = "blend"  # blending of chunk KV for prompts marked with the separator; BLEND_CHOICES
    blend_separator: str = "<|chunk|>"  # marks chunk boundaries in a text prompt; removed before the model
    blend_ratio: float = DEFAULT_RATIO  # recompute ratio floor r* (the loading controller may go higher, never lower)
    blend_select: str = "position"  # how recomputed tokens are chosen; BLEND_SELECT_CHOICES
    blend_position_tokens: int = POSITION_TOKENS  # `position` selection: the first tokens of each chunk recomputed
    blend_memory: str = "1G"  # bytes of chunk KV kept in host memory (then the SSD directory)
    runahead_ranks: int = 1  # chained prefill (KV-Runahead) over this many CPU ranks; 1 = off
    runahead_min_tokens: int = 2048  # new prompt tokens from which a prefill goes through the chain
    runahead_timeout: float = 30.0  # seconds a chain rank may wait for its peer before the prefill falls back
    runahead_threads: int = 0  # torch threads per helper rank; 0 = CPU cores / ranks
    runahead_partitions: str = ""  # partition table from `sglang-tiered runahead-tune`; "" = the default path
    importance_heads: int = 3  # query heads per layer a gated load samples; the groups' probe holds their KV heads
    importance_window: int = 32  # the prompt's last tokens whose attention decides importance
    importance_ratio: float = 0.2  # the fraction of a prompt's tokens that count as important
    importance_load: str = "off"  # "gated": SSD prefixes repacked by importance and loaded sparsely (approximate)
    importance_alpha: float = 0.6  # gate exponent: the heads' Jaccard must reach ((k/n) / (2 - k/n)) ** alpha
    importance_gate: str = "jaccard"  # "mass": pass when the picks leave out <= max_drop of the window's attention
    importance_max_drop: float = 0.15  # the mass gate's bound, a share of the window's attention
    importance_min_tokens: int = 256  # shortest stored span worth a sparse load
    importance_probe_skip: int = 4  # a layer whose gate failed on its last N measured loads skips the probe; 0 = off
    importance_probe_bits: int = 4  # bits per value of a repacked group's probe; PROBE_BITS_CHOICES
    importance_repack_memory: str = "512M"  # bytes of written pages kept for the repacker (0 = read them back)
    kvpr: str = "auto"  # compute-or-load of SSD prefixes (engine/meet.py); KVPR_CHOICES
    kvpr_min_tokens: int = 128  # shortest stored span worth a compute-or-load
    remote: str = ""  # shared tier below the SSD: "mooncake://MASTER_HOST:RPC_PORT"; "" = none
    remote_metadata: str = ""  # Mooncake metadata server URL; "" = http://MASTER_HOST:8080/metadata
    remote_segment: str = "256M"  # bytes of this server's memory lent to the shared store
    remote_host: str = ""  # address other servers reach this one at for the store; "" = the route to the master
    max_retain: float = 3600.0  # longest pin a request may ask for (custom_params.tiered_retain), seconds; 0 = off
    retain_share: float = 0.5  # pinned pages may hold at most this share of the smallest tier (device, host, SSD)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TieredConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown tiered options: {sorted(unknown)}")
        return cls(**data)

    def host_pool_settings(self) -> dict[str, Any]:
        """The SGLang fields that size the host tier: {} or {"hicache_ratio": r} or {"hicache_size": gib}."""
        text = self.host_size.strip().lower()
        if not text:
            return {}
        if text.endswith("x"):
            try:
                ratio = float(text[:-1])
            except ValueError:
                raise ConfigError(f"--tiered-host-size: not a ratio: {self.host_size!r}") from None
            if ratio <= 1.0:
                raise ConfigError(
                    f"--tiered-host-size: the host tier must be larger than the device pool, got {ratio}x"
                )
            return {"hicache_ratio": ratio}
        size = flag_size("host_size", text)
        if size == 0 or size % 1024**3:
            raise ConfigError(
                f"--tiered-host-size: SGLang sizes the host pool in whole GiB; got {self.host_size!r} "
                "(use e.g. 4G, or a ratio to the device pool such as 3x)"
            )
        return {"hicache_size": size // 1024**3}

    def remote_settings(self) -> Optional[tuple[Any, int]]:
        """(Mooncake address, segment bytes) of `--tiered-remote`, or None without one. Raises ConfigError."""
        if not self.remote:
            return None
        from sglang_tiered.storage.mooncake_store import MooncakeAddress

        try:
            address = MooncakeAddress.parse(self.remote, self.remote_metadata)
        except ValueError as exc:
            raise ConfigError(f"--tiered-remote: {exc}") from None
        segment = flag_size("remote_segment", self.remote_segment)
        if segment < 16 * 1024**2:
            raise ConfigError(f"--tiered-remote-segment: at least 16M, got {self.remote_segment!r}")
        return address, segment

    def check_page_fits(self, page_bytes: Optional[int]) -> None:
        """Raise ConfigError if the SSD capacity is smaller than one KV page of `page_bytes` (None: not known)."""
        if page_bytes is not None and self.ssd_capacity < page_bytes:
            raise ConfigError(f"--tiered-ssd-capacity: {self.ssd_capacity} bytes is smaller than one KV page "
                              f"({page_bytes} bytes)")

    def validate(self) -> None:
        """Raise ConfigError naming the flag. Creates the SSD directory if needed and checks it is writable. The
        capacity against one KV page, which needs the dtype, is `check_page_fits`."""
        if self.ssd_capacity <= 0:
            raise ConfigError(f"--tiered-ssd-capacity: must be positive, got {self.ssd_capacity}")
        if self.io_threads < 1:
            raise ConfigError(f"--tiered-io-threads: must be >= 1, got {self.io_threads}")
        if self.prefetch_threshold < 0:
            raise ConfigError(f"--tiered-prefetch-threshold: must be >= 0, got {self.prefetch_threshold}")
        if self.stats_interval < 0:
            raise ConfigError(f"--tiered-stats-interval: must be >= 0, got {self.stats_interval}")
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise ConfigError(f"--tiered-{name.replace('_', '-')}: expected one of {choices}, got "
                                  f"{getattr(self, name)!r}")
        if not self.blend_separator.strip():
            raise ConfigError("--tiered-blend-separator: must contain a visible character")
        if not 0.0 < self.blend_ratio <= 1.0:
            raise ConfigError(f"--tiered-blend-ratio: must be in (0, 1], got {self.blend_ratio}")
        flag_size("blend_memory", self.blend_memory)
        if self.runahead_ranks < 1:
            raise ConfigError(f"--tiered-runahead-ranks: must be >= 1, got {self.runahead_ranks}")
        if self.runahead_min_tokens < max(2, self.runahead_ranks):
            raise ConfigError(f"--tiered-runahead-min-tokens: must be at least the number of ranks and 2, got "
                              f"{self.runahead_min_tokens}")
        if self.runahead_timeout <= 0:
            raise ConfigError(f"--tiered-runahead-timeout: must be positive, got {self.runahead_timeout}")
        if self.runahead_threads < 0:
            raise ConfigError(f"--tiered-runahead-threads: must be >= 0, got {self.runahead_threads}")
        if self.runahead_partitions and not Path(self.runahead_partitions).expanduser().is_file():
            raise ConfigError(f"--tiered-runahead-partitions: no such file: {self.runahead_partitions}")
        if self.importance_heads < 1:
            raise ConfigError(f"--tiered-importance-heads: must be >= 1, got {self.importance_heads}")
        if self.importance_window < 1:
            raise ConfigError(f"--tiered-importance-window: must be >= 1, got {self.importance_window}")
        if not 0.0 < self.importance_ratio <= 1.0:
            raise ConfigError(f"--tiered-importance-ratio: must be in (0, 1], got {self.importance_ratio}")
        if not 0.0 < self.importance_alpha <= 10.0:
            raise ConfigError(f"--tiered-importance-alpha: must be in (0, 10], got {self.importance_alpha}")
        if not 0.0 <= self.importance_max_drop <= 1.0:
            raise ConfigError(f"--tiered-importance-max-drop: must be in [0, 1], got {self.importance_max_drop}")
        if self.importance_min_tokens < 1:
            raise ConfigError(f"--tiered-importance-min-tokens: must be >= 1, got {self.importance_min_tokens}")
        if self.importance_probe_skip < 0:
            raise ConfigError(f"--tiered-importance-probe-skip: must be >= 0, got {self.importance_probe_skip}")
        flag_size("importance_repack_memory", self.importance_repack_memory)
        if self.max_retain < 0:
            raise ConfigError(f"--tiered-max-retain: must be >= 0 seconds (0 = off), got {self.max_retain}")
        if not 0.0 < self.retain_share < 1.0:
            raise ConfigError(f"--tiered-retain-share: must be in (0, 1), got {self.retain_share}")
        if self.blend_position_tokens < 0:
            raise ConfigError(f"--tiered-blend-position-tokens: must be >= 0, got {self.blend_position_tokens}")
        if self.kvpr_min_tokens < 1:
            raise ConfigError(f"--tiered-kvpr-min-tokens: must be >= 1, got {self.kvpr_min_tokens}")
        if self.importance_load == "gated" and self.cpu_attention != "prefix_aware":
            raise ConfigError("--tiered-importance-load: 'gated' needs --tiered-cpu-attention prefix_aware (decoding "
                              "over a sparse prefix skips the tokens that were not loaded)")
        self.remote_settings()
        self.host_pool_settings()
        check_writable_dir(self.ssd_dir, "--tiered-ssd-dir")


CUDA_PREVIEW_ENV = "SGLANG_TIERED_CUDA_PREVIEW"  # "1": run the mechanisms refused on a GPU (docs/gpu.md)


def layered_reads(cfg: TieredConfig, preview: bool) -> list[str]:
    """On a CUDA server, the flags whose mechanisms read stored pages layer by layer: they need SGLang's
    `layer_first` host layout (CPU servers always run it; SGLang's default on CUDA is `page_first`)."""
    return [flag for flag, on in (("--tiered-importance-load gated", cfg.importance_load == "gated" and preview),
                                  (f"--tiered-kvpr {cfg.kvpr}", cfg.kvpr != "off" and preview)) if on]


def hooked_prefills(cfg: TieredConfig, preview: bool) -> list[str]:
    """On a CUDA server, the flags whose mechanisms compute prefills in our hook on SGLang's forward
    (integration/model_forward.py): blending, and the loaders of `layered_reads`. A prefill that SGLang replays from
    a CUDA graph (its default on CUDA) runs past that hook, so a server with any of them runs prefills eagerly
    (decode graphs stay)."""
    blends = [f"--tiered-blend {cfg.blend}"] if cfg.blend not in ("off", "prefix") else []
    return blends + layered_reads(cfg, preview)


def cuda_refusal(cfg: TieredConfig, attention_backend: Optional[str], preview: bool,
                 prefill_graph: Optional[str] = None) -> Optional[str]:
    """Why a server with CUDA cannot start with `cfg` (None: it can). Gated sparse loading and compute-or-load passed
    the GPU harness (scripts/gpu-serve.sh) but were slower than recomputing there: refused unless `preview`
    (CUDA_PREVIEW_ENV=1), and gated loading then needs SGLang's `torch_native` attention backend, the one whose
    decode skips the positions a sparse load left empty. Chained prefill runs on CPU ranks only. `prefill_graph`:
    the prefill CUDA graph backend the operator chose (None: SGLang's default); one that replays prefills is refused
    with a mechanism that computes them (`hooked_prefills`)."""
    hooked = hooked_prefills(cfg, preview)
    if hooked and prefill_graph not in (None, "disabled"):
        return (f"--cuda-graph-backend-prefill: {prefill_graph} replays prefills past the forward that {hooked[0]} "
                f"computes them in; use --cuda-graph-backend-prefill disabled (decode graphs stay) or turn "
                f"{hooked[0].split()[0]} off")
    if cfg.runahead_ranks >= 2:
        return "--tiered-runahead-ranks: chained prefill in the server runs on CPU ranks only (this machine has CUDA)"
    unverified = [flag for flag, on in (("--tiered-importance-load gated", cfg.importance_load == "gated"),
                                        ("--tiered-kvpr force", cfg.kvpr == "force")) if on]
    if unverified and not preview:
        return (f"{', '.join(unverified)}: on a CUDA server it served exactly but slower than recomputing (one H200 "
                f"run, 4k tokens); {CUDA_PREVIEW_ENV}=1 runs it (docs/gpu.md)")
    if cfg.importance_load == "gated" and attention_backend != "torch_native":
        return ("--tiered-importance-load: 'gated' on CUDA needs --attention-backend torch_native (its decode skips "
                "the positions a sparse load left empty)")
    return None


def default_partitions_path() -> Path:
    """Where `sglang-tiered runahead-tune` writes its table and the server looks for it by default."""
    return default_cache_root() / "runahead-partitions.json"


def check_writable_dir(path: str, flag: str) -> None:
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag}: {path} is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot create {path}: {exc.strerror or exc}") from None
    try:
        with tempfile.NamedTemporaryFile(dir=p, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise ConfigError(f"{flag}: {path} is not writable: {exc.strerror or exc}") from None


FLAG_HELP: dict[str, str] = {
    "ssd_dir": "Directory of the SSD tier (pages persist here across restarts). Default: %(default)s.",
    "ssd_capacity": "Bytes the SSD tier may use, summed over TP ranks (suffixes K/M/G/T); least recently used pages "
    "are evicted beyond it. Default: 16G.",
    "host_size": "Host DRAM tier size: whole GiB (e.g. 4G) or a ratio to the device pool (e.g. 3x). "
    "Default: SGLang's --hicache-ratio default (2x).",
    "namespace": "Salt mixed into the page namespace: servers with different salts never share pages.",
    "prefetch_threshold": "Shortest stored prefix (tokens) worth loading from SSD; 0 = one page. "
    "SGLang's own default is 256.",
    "io_threads": "Parallel file reads/writes per rank.",
    "stats_interval": "Seconds between tier statistics log lines (0 = off).",
    "cpu_attention": "Without CUDA: 'prefix_aware' computes attention for the new tokens only (a cache hit costs the "
    "new tokens); 'torch_native' keeps SGLang's full-sequence attention. Default: prefix_aware.",
    "blend": "Prompts whose text marks chunks with --tiered-blend-separator reuse each chunk's stored KV wherever "
    "it appears: 'blend' recomputes some tokens of every chunk (which: --tiered-blend-select), 'single' selects "
    "them at one check layer (LMCache's scheme), 'reuse' recomputes none, 'full' recomputes all; 'prefix' and 'off' "
    "leave the prompt to SGLang's radix cache (the separator is still removed with 'prefix'). On CUDA a server "
    "that blends runs prefills without SGLang's prefill CUDA graph (docs/gpu.md). Default: blend.",
    "blend_separator": "Text that marks chunk boundaries; every part before the last separator is a reusable chunk, "
    "the part after it (the question) is always computed. Default: <|chunk|>.",
    "blend_ratio": "Under --tiered-blend-select deviation or importance: the fraction of reused tokens recomputed "
    "per layer, the quality floor; the loading controller raises it when loading is slower than recomputing. "
    "Default: 0.15.",
    "blend_select": "How 'blend' and 'single' rank the reused tokens they recompute: 'deviation' (CacheBlend: how far "
    "a token's stored KV is from its fresh KV) or 'importance' (that and the attention the prompt's last "
    "--tiered-importance-window tokens give it, each as a share of its total), or 'position' (EPIC's LegoLink: no "
    "ranking, the first --tiered-blend-position-tokens tokens of every chunk recomputed on every layer, no deviation "
    "pass; on HotpotQA it agreed with the exact prefill as often as 'deviation' at 0.70x its TTFT). Default: "
    "position.",
    "blend_position_tokens": "Under --tiered-blend-select position: the first tokens of each reused chunk recomputed "
    "on every layer (where a chunk computed on its own put its attention sink). Default: 32.",
    "blend_memory": "Host memory for stored chunk KV (suffixes K/M/G); beyond it chunks live on the SSD directory "
    "only. Default: 1G.",
    "runahead_ranks": "Prefill long prompts by KV-Runahead: a chain of this many ranks (this scheduler plus N-1 helper "
    "processes on this machine, each with a full copy of the weights) passing the KV cache along point to point. "
    "CPU servers only, TP = PP = 1. 1 = off (default).",
    "runahead_min_tokens": "New prompt tokens from which a prefill goes through the chain. Default: 2048.",
    "runahead_timeout": "Seconds a chain rank waits for its peer; a dead or stalled rank makes the prefill fall back "
    "to SGLang's own (the chain restarts in the background). Default: 30.",
    "runahead_threads": "Torch threads per helper rank; 0 = CPU cores divided by the number of ranks.",
    "importance_heads": "Query heads per layer a gated sparse load samples to score stored tokens (spread over the "
    "KV-head groups); repacked groups' probe holds their KV heads. Default: 3.",
    "importance_window": "The prompt's last tokens (the question) whose attention scores the other tokens, in a "
    "gated sparse load and in blend's importance selection. Default: 32.",
    "importance_ratio": "Fraction of a stored prefix each sampled head picks in a gated sparse load. Default: 0.2.",
    "importance_load": "'gated': prefixes on SSD are repacked with a probe in the background, and a request "
    "whose prefix must come from SSD loads, layer by layer, only the tokens its sampled heads pick when they agree "
    "(Jaccard gate), everything otherwise -- approximate, opt-in. On such a server a request opts out with "
    "custom_params.tiered_importance = 'off', or takes the same path loading everything (exact) with 'full'. "
    "CPU servers (on CUDA: a preview, docs/gpu.md). Default: off.",
    "importance_alpha": "Gate exponent alpha: the sampled heads' mean Jaccard must reach ((k/n)/(2-k/n))**alpha. "
    "Higher passes more layers (fewer bytes read, answers further from a full load); 1.0 passes whenever the heads "
    "agree more than chance. Default: 0.6.",
    "importance_gate": "Which gate decides per layer whether a gated load takes only the picked tokens: 'jaccard' "
    "(IMPRESS: the sampled heads' top-k sets agree, see --tiered-importance-alpha) or 'mass' (the picks leave out at "
    "most --tiered-importance-max-drop of the attention the prompt's last tokens give, estimated from the probe; on "
    "SmolLM2 closer to a full load at fewer bytes, see the README); per request custom_params.tiered_importance_gate. "
    "Default: jaccard.",
    "importance_max_drop": "The 'mass' gate's bound: the largest share of the attention of the prompt's last tokens "
    "(over the probed heads) that may fall on stored tokens a layer leaves out. Lower loads more. Default: 0.15.",
    "importance_min_tokens": "Shortest stored span (tokens) that a gated request loads sparsely. Default: 256.",
    "importance_probe_skip": "A layer whose gate failed on each of its last N measured sparse loads loads the whole "
    "stored span without reading its probe first (what a failed gate loads anyway, less the probe's bytes); every "
    "8th load measures every layer again. 0: always probe. Default: 4.",
    "importance_probe_bits": "Bits per value of the probe a repacked prefix stores for gated loading (the sampled "
    "heads' keys): 4 (rotated by a Hadamard matrix first; half the bytes of 8) or 8. Fewer probe bytes per sparse "
    "load; the gate and the picks see slightly noisier keys. Default: 4.",
    "importance_repack_memory": "Host memory (suffixes K/M/G) that keeps a copy of the pages written to SSD for a "
    "prompt about to be repacked for gated loading, so the repack does not read them back from the SSD; pages "
    "beyond it are read back. 0: always read back. Default: 512M.",
    "kvpr": "Compute-or-load of stored spans (exact; CPU servers, on CUDA a preview): a prefix that must come back "
    "from SSD has its front prefilled from token ids while its back is read, page by page from the end; the two meet "
    "where the disk's and the CPU's speeds put them. On models whose attention input is smaller than their KV "
    "(multi-head attention) pages written through also store it, and the loader reads those pages as activations and "
    "recomputes their K, V (KVPR). 'auto' decides per request from the measured read rate and compute profile "
    "(`sglang-tiered kvpr-profile`): SGLang's load where reads are fast, SGLang's forward where they are very slow, "
    "else the two-sided load; 'force' always loads two-sided. Per request custom_params.tiered_kvpr = 'off' | 'auto' "
    "| 'force' | tokens to compute (the meet point; 0 = read everything). Default: auto.",
    "kvpr_min_tokens": "Shortest stored span (tokens) loaded by our loader. Default: 128.",
    "remote": "Shared KV tier below the local SSD on Mooncake Store: mooncake://MASTER_HOST:RPC_PORT (start "
    "`mooncake_master --enable_http_metadata_server=true` first). Pages written to SSD are also published to it in "
    "the background; a page missing locally is fetched from it, checked and kept on the local SSD, so every server "
    "pointing at the same master reuses what one computed. If the master does not answer, the server runs on its "
    "local tiers and reconnects by itself. Default: none.",
    "remote_metadata": "Mooncake metadata server URL. Default: http://MASTER_HOST:8080/metadata (the master's own "
    "HTTP metadata server).",
    "remote_segment": "Memory this server lends to the shared store (suffixes K/M/G; at least 16M); the store's "
    "capacity is the sum over its servers. Default: 256M.",
    "remote_host": "Address (HOST or HOST:PORT) other servers reach this one at for transfers. Default: this "
    "machine's address on the route to the master, and a free port.",
    "max_retain": "Longest retention a request may ask for with custom_params.tiered_retain (seconds): its prompt's "
    "pages are kept ahead of every unpinned page on device, host and SSD until then (evicted from device or host only "
    "when nothing unpinned is left; never from the SSD before expiry). 0 turns retention off (and keeps "
    "SGLang's Rust tree core, which cannot rank pinned nodes). Default: 3600.",
    "retain_share": "Pinned pages may hold at most this share of the smallest tier (device pool, host pool, SSD "
    "capacity, in pages); beyond it the oldest pins are released early (counted). Default: 0.5.",
    "runahead_partitions": "Partition table written by `sglang-tiered runahead-tune` (default: "
    "~/.cache/sglang-tiered/runahead-partitions.json if present; without one, a FLOP-balanced split).",
}
