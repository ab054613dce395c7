"""`--kv-backend` and `--tiered-*` in SGLang's own parser, and startup errors for bad values (no server starts)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import pytest

from sglang_tiered.server_process import signal_group

pytestmark = pytest.mark.server  # launcher processes, no serving


SGLANG_CLI = os.path.join(os.path.dirname(sys.executable), "sglang")


def launch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", *args]


class Launch:
    """A launcher process started now, read when a test asks for its result; its output goes to files (SGLang's
    `--help` is more than a pipe holds)."""

    def __init__(self, cmd: list[str], out: Path, env: Optional[dict] = None) -> None:
        self.out, self.err = out.with_suffix(".out"), out.with_suffix(".err")
        with open(self.out, "w") as o, open(self.err, "w") as e:
            self.proc = subprocess.Popen(cmd, stdout=o, stderr=e, start_new_session=True, env=env)

    def result(self, timeout: float = 120) -> subprocess.CompletedProcess:
        self.proc.wait(timeout=timeout)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, self.out.read_text(),
                                           self.err.read_text())

    def stop(self) -> None:
        signal_group(self.proc, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory) -> Iterator[dict[str, Launch]]:
    """The launcher processes that this run's selected tests read (their `launch` marks), all started at once: each
    is mostly SGLang's import (~11 s of one core), so four at a time on two cores take about half as long as four
    in a row. `claimed`: a launch on an SSD directory this process has claimed first, as a launcher does
    (storage/directory_lock.py)."""
    wanted = {mark.args[0] for item in request.session.items if item.module is request.module
              for mark in item.iter_markers("launch")}
    tmp = tmp_path_factory.mktemp("launches")
    started: dict[str, Launch] = {}
    try:
        if "help" in wanted:
            started["help"] = Launch(launch_cmd("--help"), tmp / "help")
        if "serve" in wanted:
            # `sglang serve` first asks the Hugging Face hub whether the model path names a diffusion model, which on
            # a machine without network waits ~20 s for DNS: HF_HUB_OFFLINE
            started["serve"] = Launch([SGLANG_CLI, "serve", "--model-path", "smollm2", "--kv-backend", "tiered",
                                       "--tiered-ssd-dir", str(tmp / "serve-ssd"), "--tiered-ssd-capacity", "100K",
                                       "--max-total-tokens", "1024"], tmp / "serve",
                                      env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if "bad" in wanted:
            started["bad"] = Launch(launch_cmd("--kv-backend", "tiered", "--model-path", "smollm2",
                                               "--max-total-tokens", "1024", "--tiered-ssd-dir", str(tmp / "bad-ssd"),
                                               "--tiered-blend-ratio", "0"), tmp / "bad")
        if "claimed" in wanted:
            claim_and_launch(started, tmp)
        if "no-compiler" in wanted:
            # a machine without a C++ compiler, in an environment where SGLang's page-key hash was never built
            started["no-compiler"] = Launch(
                launch_cmd("--model-path", "smollm2", "--kv-backend", "tiered", "--tiered-ssd-dir",
                           str(tmp / "cc-ssd"), "--max-total-tokens", "1024"), tmp / "no-compiler",
                env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp / "extensions"), "CXX": str(tmp / "no-such-c++")})
        yield started
    finally:
        for launch in started.values():
            launch.stop()


def claim_and_launch(started: dict[str, Launch], tmp: Path) -> None:
    """Parses flags naming an SSD directory in this process (twice: a process may parse them again), which claims
    it, then starts a launcher on the same directory as `started["claimed"]`."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    claimed = ["--model-path", "smollm2", "--kv-backend", "tiered", "--tiered-ssd-dir", str(tmp / "claimed-ssd"),
               "--dtype", "float32"]
    ServerArgs.from_cli_args(parser.parse_args(claimed))
    ServerArgs.from_cli_args(parser.parse_args(claimed))
    started["claimed"] = Launch(launch_cmd(*claimed, "--max-total-tokens", "1024"), tmp / "claimed")


@pytest.mark.launch("help")
def test_help_lists_our_flags(launches):
    out = launches["help"].result().stdout
    for flag in ("--kv-backend {default,tiered}", "--tiered-ssd-dir", "--tiered-ssd-capacity", "--tiered-host-size",
                 "--tiered-namespace", "--tiered-prefetch-threshold",
                 "--tiered-blend {off,full,prefix,reuse,single,blend}", "--tiered-blend-separator",
                 "--tiered-blend-ratio", "--tiered-blend-select {deviation,importance,position}",
                 "--tiered-blend-position-tokens", "--tiered-blend-memory",
                 "--tiered-runahead-ranks", "--tiered-runahead-min-tokens", "--tiered-runahead-timeout",
                 "--tiered-runahead-threads",
                 "--tiered-runahead-partitions", "--tiered-remote", "--tiered-remote-metadata",
                 "--tiered-remote-segment", "--tiered-remote-host", "--tiered-importance-repack-memory",
                 "--tiered-importance-gate {jaccard,mass}", "--tiered-importance-max-drop",
                 "--tiered-kvpr {off,auto,force}", "--tiered-kvpr-min-tokens"):
        assert flag in out, flag


@pytest.mark.launch("serve")
@pytest.mark.slow
def test_sglang_serve_parses_and_translates_our_flags(launches):
    """`sglang serve --help` prints before SGLang loads plugins; a real `sglang serve` run does load them."""
    r = launches["serve"].result()
    assert r.returncode == 2 and "sglang-tiered: --tiered-ssd-capacity:" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--tiered-ssd-dir", "/proc/sglang-tiered-not-writable"], "--tiered-ssd-dir"),
        (["--tiered-ssd-capacity", "100K"], "--tiered-ssd-capacity"),
        (["--tiered-ssd-capacity", "lots"], "--tiered-ssd-capacity"),
        (["--tiered-host-size", "1500M"], "--tiered-host-size"),
        (["--hicache-storage-backend", "file"], "--hicache-storage-backend"),
        (["--disable-radix-cache"], "--disable-radix-cache"),
        (["--hicache-mem-layout", "page_first_direct"], "--hicache-mem-layout"),
        (["--tiered-blend-ratio", "0"], "--tiered-blend-ratio"),
        (["--tiered-blend-memory", "a lot"], "--tiered-blend-memory"),
        (["--tiered-blend-separator", " "], "--tiered-blend-separator"),
        (["--tiered-runahead-ranks", "0"], "--tiered-runahead-ranks"),
        (["--tiered-runahead-ranks", "2", "--tp-size", "2"], "--tiered-runahead-ranks"),
        (["--tiered-runahead-ranks", "4", "--tiered-runahead-min-tokens", "3"], "--tiered-runahead-min-tokens"),
        (["--tiered-runahead-timeout", "0"], "--tiered-runahead-timeout"),
        (["--tiered-importance-probe-skip", "-1"], "--tiered-importance-probe-skip"),
        (["--tiered-importance-repack-memory", "5 bytes"], "--tiered-importance-repack-memory"),
        (["--tiered-importance-max-drop", "-0.1"], "--tiered-importance-max-drop"),
        (["--tiered-runahead-partitions", "/nonexistent/table.json"], "--tiered-runahead-partitions"),
        (["--tiered-remote", "http://127.0.0.1:50051"], "--tiered-remote"),
        (["--tiered-remote", "mooncake://127.0.0.1"], "--tiered-remote"),
        (["--tiered-remote", "mooncake://127.0.0.1:1", "--tiered-remote-metadata", "etcd://x"], "--tiered-remote"),
        (["--tiered-remote", "mooncake://127.0.0.1:1", "--tiered-remote-segment", "1M"], "--tiered-remote-segment"),
    ],
)
def test_bad_value_stops_startup_with_one_line(tmp_path, capsys, monkeypatch, extra, flag):
    """What `python -m sglang.launch_server` runs before it starts anything -- load the plugins, then
    `prepare_server_args(argv)` -- in this process (a real launch of one case: the next test). Only a capacity below
    one page, whose size depends on the dtype, waits for `--dtype auto` to time the linears."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    from sglang_tiered.policy import cpu_dtype

    args = ["--kv-backend", "tiered", "--model-path", "smollm2", "--max-total-tokens", "1024"]
    if "--tiered-ssd-dir" not in extra:
        args += ["--tiered-ssd-dir", str(tmp_path / "ssd")]
    if extra != ["--tiered-ssd-capacity", "100K"]:
        monkeypatch.setattr(cpu_dtype, "choose_dtype", lambda *a: pytest.fail("the dtype was timed before the check"))
    load_plugins()
    with pytest.raises(SystemExit) as stopped:
        prepare_server_args([*args, *extra])
    err = capsys.readouterr().err
    assert stopped.value.code == 2, err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("sglang-tiered:")]
    assert len(lines) == 1 and lines[0].startswith(f"sglang-tiered: {flag}:"), err[-2000:]
    assert "Traceback" not in err


@pytest.mark.launch("bad")
def test_a_real_launch_with_a_bad_value_exits_2_with_one_line(launches):
    r = launches["bad"].result()
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("sglang-tiered:")]
    assert len(lines) == 1 and lines[0].startswith("sglang-tiered: --tiered-blend-ratio:"), r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_translation_into_sglang_fields(tmp_path, monkeypatch):
    """SGLang's own parser and ServerArgs.from_cli_args, with the plugin's hooks applied in this process; our
    settings reach SGLang's processes through one channel (integration/settings.py)."""
    import json

    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    from sglang_tiered.integration import settings
    from sglang_tiered.integration.server_flags import CPU_OVERLAP_ENV

    load_plugins()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", "smollm2", "--kv-backend", "tiered", "--tiered-ssd-dir", str(tmp_path),
                            "--tiered-ssd-capacity", "2G", "--tiered-host-size", "3x", "--tiered-namespace", "t1",
                            "--dtype", "bfloat16"])
    args = ServerArgs.from_cli_args(ns)
    assert args.enable_hierarchical_cache and args.radix_cache_backend == "tiered"
    assert args.hicache_storage_backend == "dynamic" and args.page_size == 64 and args.hicache_ratio == 3.0
    assert args.model_path.endswith("SmolLM2-135M-Instruct") and args.tokenizer_path == args.model_path
    assert (args.device, args.dtype, args.hicache_mem_layout, args.hicache_io_backend) == (
        "cpu", "bfloat16", "layer_first", "direct")
    assert args.disable_overlap_schedule  # CPU: a batch's result does not wait for the next batch's forward
    extra = json.loads(args.hicache_storage_backend_extra_config)
    assert extra["class_name"] == "TieredSSDStorage" and extra["interface_v1"] == 1
    assert extra["prefetch_threshold"] == 64 and "tiered" not in extra  # only what SGLang reads
    current = settings.current()
    assert current.model.startswith("SmolLM2-135M-Instruct:") and current.cpu_only and current.vocab_size == 49152
    assert current.config.ssd_capacity == 2 << 30 and current.config.namespace == "t1"
    assert not current.runahead_on  # runahead off by default

    ns = parser.parse_args(["--model-path", "smollm2", "--kv-backend", "tiered", "--tiered-ssd-dir", str(tmp_path),
                            "--tiered-runahead-ranks", "2", "--tiered-runahead-min-tokens", "512"])
    ServerArgs.from_cli_args(ns)
    current = settings.current()
    assert current.config.runahead_ranks == 2 and current.config.runahead_min_tokens == 512
    assert current.runahead_threads >= 1 and current.model_path == args.model_path

    monkeypatch.setenv(CPU_OVERLAP_ENV, "1")  # the operator keeps SGLang's overlap loop
    kept = ServerArgs.from_cli_args(parser.parse_args(["--model-path", "smollm2", "--kv-backend", "tiered",
                                                       "--tiered-ssd-dir", str(tmp_path)]))
    assert not kept.disable_overlap_schedule

    plain = ServerArgs.from_cli_args(parser.parse_args(["--model-path", "smollm2"]))
    assert not plain.enable_hierarchical_cache and plain.radix_cache_backend is None  # default backend untouched
    assert not plain.disable_overlap_schedule
    assert settings.current() is None  # and no tiered settings reach its processes


def cuda_translation(tmp_path: Path, extra: list[str], preview: bool,
                     refused: Optional[str]) -> Optional[argparse.Namespace]:
    """`extra` parsed by SGLang's own parser, then the CUDA branch of our translation (`_cuda_settings`, which a
    CPU machine never reaches by itself): the namespace it left, or None where it refused as `refused` expects."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    from sglang_tiered.config import ConfigError
    from sglang_tiered.integration.server_flags import _cuda_settings, config_from_namespace

    load_plugins()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", "smollm2", "--kv-backend", "tiered", "--tiered-ssd-dir", str(tmp_path),
                            *extra])
    if refused is not None:
        with pytest.raises(ConfigError, match=refused):
            _cuda_settings(ns, config_from_namespace(ns), preview=preview)
        return None
    _cuda_settings(ns, config_from_namespace(ns), preview=preview)
    return ns


@pytest.mark.parametrize("extra, preview, layout, refused", [
    ([], False, "page_first", None),  # SGLang's default on CUDA
    (["--tiered-kvpr", "force"], True, "layer_first", None),  # compute-or-load reads pages layer by layer
    (["--tiered-importance-load", "gated", "--attention-backend", "torch_native"], True, "layer_first", None),
    (["--tiered-kvpr", "force", "--hicache-mem-layout", "page_first_direct"], True, None,
     "--hicache-mem-layout: --tiered-kvpr force reads stored pages layer by layer"),
])
def test_a_cuda_server_with_layer_by_layer_reads_runs_the_layer_first_host_layout(tmp_path, extra, preview, layout,
                                                                                  refused):
    """The CUDA branch of the translation, on SGLang's own parser: SGLang's host layout there is `page_first`
    unless given, which compute-or-load and gated loading cannot read layer by layer."""
    ns = cuda_translation(tmp_path, extra, preview, refused)
    if ns is None:
        return
    assert ns.hicache_mem_layout == layout


@pytest.mark.parametrize("extra, disabled, refused", [
    ([], True, None),  # blending is on by default: prefills run eagerly, decode graphs stay
    (["--tiered-blend", "off"], False, None),  # nothing of ours computes a prefill: SGLang's default stands
    (["--disable-cuda-graph"], False, None),  # already off
    (["--cuda-graph-config", '{"prefill": {"backend": "disabled"}}'], False, None),
    (["--cuda-graph-backend-prefill", "breakable"], False, "--cuda-graph-backend-prefill: breakable replays"),
    (["--disable-cuda-graph", "--cuda-graph-config", '{"prefill": {"backend": "full"}}'], False, "full replays"),
])
def test_a_cuda_server_runs_prefills_where_our_hook_sees_them(tmp_path, extra, disabled, refused):
    """The CUDA branch of the translation, on SGLang's own parser: SGLang replays prefills from a CUDA graph by
    default there, which runs past the forward hook that blending computes in."""
    ns = cuda_translation(tmp_path, extra, False, refused)
    if ns is None:
        return
    assert ns.disable_prefill_cuda_graph == disabled and not ns.disable_decode_cuda_graph


@pytest.mark.launch("claimed")
@pytest.mark.slow
def test_a_second_server_on_a_claimed_ssd_directory_exits_2_naming_the_first(launches):
    """One server per `--tiered-ssd-dir` (storage/directory_lock.py): the flags parsed in this process claimed the
    directory, as a launcher does (`launches`); a server started on it meanwhile stops at once with one line naming
    this process."""
    r = launches["claimed"].result()
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("sglang-tiered:")]
    assert len(lines) == 1 and lines[0].startswith("sglang-tiered: --tiered-ssd-dir:"), r.stderr[-2000:]
    assert f"in use by another server (pid {os.getpid()})" in lines[0] and "Traceback" not in r.stderr


@pytest.mark.launch("no-compiler")
@pytest.mark.slow
def test_a_machine_that_cannot_build_sglangs_page_key_hash_stops_at_startup(launches):
    """SGLang builds its page-key hash (a C++ extension) on first use; the launcher builds it before any process
    serves, so a machine without a compiler stops at startup, with the build's reason, instead of at its first
    request."""
    r = launches["no-compiler"].result()
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("sglang-tiered:")]
    assert len(lines) == 1 and lines[0].startswith("sglang-tiered: --kv-backend tiered: SGLang's page-key hash"), \
        r.stderr[-2000:]
    assert "no-such-c++: not found" in lines[0] and "Traceback" not in r.stderr, lines[0]


def test_dtype_auto_is_kept_in_the_ssd_directory_for_restarts(tmp_path):
    """`--dtype auto` is measured once per machine and model and kept in `<ssd dir>/cpu-dtype.json`: a restart
    reuses it (the dtype is in every page's namespace: a restart that measured the other dtype would find the whole
    tier foreign -- seen on a CPU where bf16 and fp32 time within noise of each other). An unreadable file is
    measured again and rewritten; records of other machines or models are kept beside."""
    import json

    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    from sglang_tiered.storage.ssd_tier import DTYPE_FILE

    load_plugins()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)

    def dtype() -> str:
        argv = ["--model-path", "smollm2", "--kv-backend", "tiered", "--tiered-ssd-dir", str(tmp_path)]
        return ServerArgs.from_cli_args(parser.parse_args(argv)).dtype

    path = tmp_path / DTYPE_FILE
    first = dtype()
    records = json.loads(path.read_text())
    assert len(records) == 1 and first in ("bfloat16", "float32")
    (signature, record), = records.items()
    assert record["dtype"] == first and set(record["seconds"]) == {"bfloat16", "float32"}
    other = "float32" if first == "bfloat16" else "bfloat16"
    path.write_text(json.dumps({"another machine|model": {**record, "dtype": other},
                                signature: {**record, "dtype": other}}))
    assert dtype() == other  # the kept choice decides, not a new measurement
    path.write_text("{not json")
    assert dtype() in ("bfloat16", "float32")
    assert list(json.loads(path.read_text())) == [signature]  # measured again, rewritten
    path.write_text(json.dumps({"another machine|model": record}))
    dtype()
    assert list(json.loads(path.read_text())) == ["another machine|model", signature]


@pytest.mark.slow
def test_runahead_tune_writes_the_table_the_server_picks_up(tmp_path, monkeypatch):
    """`sglang-tiered runahead-tune` measures splits on real ranks (progress on stdout; a small random checkpoint
    keeps it quick) and writes the table to the default path, where `--tiered-runahead-ranks` finds it without
    `--tiered-runahead-partitions`."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    from sglang_tiered.engine.llama import LlamaConfig, save_random_checkpoint
    from sglang_tiered.integration import settings
    from sglang_tiered.policy.partition import PartitionTable

    small = save_random_checkpoint(tmp_path / "small", LlamaConfig(hidden=64, layers=2, heads=4, kv_heads=2,
                                                                    head_dim=16, intermediate=128, vocab=512))
    cli = os.path.join(os.path.dirname(sys.executable), "sglang-tiered")
    r = subprocess.run([cli, "runahead-tune", "--ranks", "2", "--lengths", "128", "256", "--repeats", "1",
                        "--model-path", str(small)],
                       capture_output=True, text=True, timeout=300, start_new_session=True,
                       env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "best split" in r.stdout and "split 0." in r.stdout  # progress per candidate and per length
    path = tmp_path / "sglang-tiered" / "runahead-partitions.json"
    table = PartitionTable.load(path)
    assert sorted(table.entries[2]) == [128, 256]
    assert all(abs(sum(f) - 1) < 1e-9 and f[0] >= 0.5 for f in table.entries[2].values())

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    load_plugins()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ServerArgs.from_cli_args(parser.parse_args(["--model-path", "smollm2", "--kv-backend", "tiered",
                                                "--tiered-ssd-dir", str(tmp_path / "ssd"),
                                                "--tiered-runahead-ranks", "2"]))
    assert settings.current().runahead_partitions == str(path)
    settings.clear()
