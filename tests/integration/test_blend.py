"""Fusion of stored chunk KV in a real SGLang server (CPU, the embedded SmolLM2, bf16, `--tiered-blend blend`).

The answer needs facts from two chunks ("Alice works at the Amber Museum." / "The Amber Museum is in Lisbon.").
1. first request: both chunks are new -> standalone KV computed and stored, then fused; the answer names Lisbon;
2. the same prompt again: chunk KV comes from the store (no new chunk), same answer; the same documents through
   /v1/chat/completions (separators in the user message) reuse the stored chunks too;
3. after a restart on the same SSD directory: chunk KV is read from SSD, same answer;
4. chunk pages corrupted on disk: the request falls back to SGLang's normal prefill (logged), still answered;
5. marked requests sent together with plain ones each prefill alone and are all fused (counted in /metrics, no
   fallback); with chunked prefill in 64-token pieces a prompt is fused piece by piece; with --enable-mixed-chunk
   a marked request that shares its forward with decode rows gets a normal prefill, logged and counted;
and `--tiered-blend full` (fusion machinery, every token recomputed) in fp32 equals SGLang's own prefill exactly.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sglang_tiered.server_process import ServerProcess, metric_total

SEP = "<|chunk|>"
FILLER = "The weather was mild that spring and the gardens along the river were full of visitors. " * 3
CHUNK_A = "Alice works at the Amber Museum. " + FILLER
CHUNK_B = FILLER + "The Amber Museum is in Lisbon."
SYSTEM = "Answer the question using the documents."
QUESTION = "\nQuestion: In which city does Alice work?"
HEAD = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"  # SmolLM2's chat template, written out
TAIL = f"{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
PROMPT = HEAD + SEP + CHUNK_A + SEP + CHUNK_B + SEP + TAIL


def server(tmp: Path, name: str, *extra: str) -> ServerProcess:
    args = ["--kv-backend", "tiered", "--max-total-tokens", "2048", "--tiered-ssd-dir", str(tmp / "ssd"),
            "--tiered-stats-interval", "0", *extra]
    return ServerProcess(args, log_path=tmp / f"{name}.log", model_path="smollm2")


def blend_lines(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if "tiered blend: rid" in line]


def test_answer_from_two_chunks_then_from_the_store_and_from_ssd(tmp_path):
    with server(tmp_path, "first") as s:
        first = s.generate(PROMPT, max_new_tokens=16)
        again = s.generate(PROMPT, max_new_tokens=16)
        chat = json.loads(s.post("/v1/chat/completions", {
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": SEP + CHUNK_A + SEP + CHUNK_B + SEP + QUESTION}],
            "max_tokens": 16, "temperature": 0}))
    assert "Lisbon" in first["text"], first["text"]
    assert again["text"] == first["text"]
    lines = blend_lines(tmp_path / "first.log")
    assert len(lines) == 3, lines
    assert "chunks=3 (new 3)" in lines[0] and "chunks=3 (new 0)" in lines[1], lines
    assert re.search(r"computed=0\.[1-3]\d\d", lines[1]), lines[1]  # 2 full layers of 30 + ~15 % of the rest
    assert list((tmp_path / "ssd" / "chunks").rglob("*.kvp")), "chunk KV was not written through to SSD"
    assert "Lisbon" in chat["choices"][0]["message"]["content"], chat
    assert "chunks=3 (new 0)" in lines[2], lines  # the chat template rendered the same header: all chunks stored

    with server(tmp_path, "restart") as s:
        after = s.generate(PROMPT, max_new_tokens=16)
    assert after["text"] == first["text"]
    lines = blend_lines(tmp_path / "restart.log")
    assert "(new 0)" in lines[0] and "'memory': 0, 'ssd': 3" in lines[0], lines

    for page in (tmp_path / "ssd" / "chunks").rglob("*.kvp"):  # flip a byte in every stored chunk layer
        data = bytearray(page.read_bytes())
        data[-5] ^= 0xFF
        page.write_bytes(bytes(data))
    with server(tmp_path, "corrupt") as s:
        fallback = s.generate(PROMPT, max_new_tokens=16)
    assert fallback["text"].strip()
    lines = blend_lines(tmp_path / "corrupt.log")
    assert len(lines) == 1 and "runs a normal prefill (chunk KV unavailable" in lines[0], lines


def short_rag_prompt(name: str, museum: str, city: str) -> str:
    """Under one 64-token page: SGLang's storage prefetch (which admits requests one by one as each lookup ends)
    does not start, so requests that arrive together are batched together."""
    return (HEAD + SEP + f"{name} works at the {museum} Museum." + SEP + f"The {museum} Museum is in {city}." + SEP
            + f"\nQuestion: In which city does {name} work?<|im_end|>\n<|im_start|>assistant\n")


def test_concurrent_marked_requests_each_prefill_alone_and_are_all_fused(tmp_path):
    """Without keeping them apart, SGLang batches requests that arrive together, and fusion (one request per extend
    batch) would fall back for every marked request in a shared batch."""
    marked = [short_rag_prompt(*x) for x in (("Alice", "Amber", "Lisbon"), ("Bruno", "Cedar", "Oslo"),
                                              ("Chiara", "Granite", "Quito"), ("Dev", "Harbor", "Lima"))]
    prompts = [*marked, "The gardens along the river", "Museums in Lisbon are"]  # the last two are plain prompts
    with server(tmp_path, "concurrent", "--enable-metrics") as s:
        alone = s.generate(marked[0], max_new_tokens=12)
        for _ in range(2):
            with ThreadPoolExecutor(len(prompts)) as pool:
                outs = list(pool.map(lambda t: s.generate(t, max_new_tokens=12), prompts))
        program = frontend_program(s.url)
        metrics = s.get("/metrics")
    log = (tmp_path / "concurrent.log").read_text()
    # requests were waiting while one was admitted: SGLang would have put them in the same batch (the token budget
    # holds them all); without the scheduler hook this test fuses 3 of 9 (checked)
    assert re.search(r"Prefill batch, #new-seq: 1, .*#queue-req: [1-9]", log), "no request ever waited: shows nothing"
    lines = blend_lines(tmp_path / "concurrent.log")
    assert not [line for line in lines if "normal prefill" in line], lines
    assert metric_total(metrics, "sglang_tiered:blend_requests_total") == 10  # 9 + the frontend program
    assert metric_total(metrics, "sglang_tiered:blend_fallbacks_total") == 0
    assert outs[0]["text"] == alone["text"]  # the same fusion, next to other requests
    assert all(o["text"].strip() for o in outs), outs
    # the frontend renders its own chat header (a new part) and reuses both of Bruno's stored documents
    assert program.strip() and "chunks=3 (new 1)" in lines[-1], lines[-1]


def frontend_program(url: str) -> str:
    """An SGLang frontend program (its own chat template, text sent to /generate) with separators in a user turn."""
    import sglang as sgl

    @sgl.function
    def rag(s, docs: list[str], question: str):
        s += sgl.system(SYSTEM)
        s += sgl.user(SEP + SEP.join(docs) + SEP + question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=12, temperature=0))

    docs = ["Bruno works at the Cedar Museum.", "The Cedar Museum is in Oslo."]
    state = rag.run(docs=docs, question="\nQuestion: In which city does Bruno work?",
                    backend=sgl.RuntimeEndpoint(url))
    return state["answer"]


def test_chunked_prefill_is_fused_piece_by_piece(tmp_path):
    with server(tmp_path, "chunked", "--chunked-prefill-size", "64", "--enable-metrics") as s:
        first = s.generate(PROMPT, max_new_tokens=16)
        metrics = s.get("/metrics")
    lines = blend_lines(tmp_path / "chunked.log")
    pieces = [tuple(map(int, re.search(r"extend=\[(\d+),(\d+)\)", line).groups())) for line in lines]
    total = first["meta_info"]["prompt_tokens"]
    assert total > 128 and pieces == [(a, min(a + 64, total)) for a in range(0, total, 64)], pieces
    new = [int(re.search(r"\(new (\d+)\)", line).group(1)) for line in lines]
    assert sum(new) == 3 and new[0] >= 1, lines  # every chunk's KV computed once, in the piece that first meets it
    assert "Lisbon" in first["text"], first["text"]
    assert metric_total(metrics, "sglang_tiered:blend_requests_total") == 1  # a request, not a piece


def test_a_marked_request_in_a_mixed_batch_falls_back_counted(tmp_path):
    """With --enable-mixed-chunk SGLang puts a new prefill next to running decodes: fusion (one request per forward)
    cannot run, the marked request gets SGLang's normal prefill, logged and counted, and is still answered."""
    with server(tmp_path, "mixed", "--enable-mixed-chunk", "--enable-metrics") as s:
        with ThreadPoolExecutor(1) as pool:
            decoding = pool.submit(s.generate, "The gardens along the river", 400)  # decodes for seconds
            deadline = time.monotonic() + 60
            while "Decode batch" not in (tmp_path / "mixed.log").read_text():
                assert time.monotonic() < deadline, "the plain request never decoded"
                time.sleep(0.2)
            marked = s.generate(PROMPT, max_new_tokens=8)
            assert decoding.result()["text"].strip()
        metrics = s.get("/metrics")
    assert marked["text"].strip()
    lines = blend_lines(tmp_path / "mixed.log")
    assert any("runs a normal prefill (its prefill batch holds 2 requests)" in line for line in lines), lines
    assert metric_total(metrics, "sglang_tiered:blend_fallbacks_total") >= 1


def test_full_mode_equals_sglang_prefill_and_off_leaves_the_separator_alone(tmp_path):
    """fp32: our engine writing every token's KV into SGLang's pool gives SGLang's own greedy tokens."""
    with server(tmp_path, "full", "--tiered-blend", "full", "--dtype", "float32") as s:
        fused = s.generate(PROMPT, max_new_tokens=24)
    with server(tmp_path, "prefix", "--tiered-blend", "prefix", "--dtype", "float32") as s:
        native = s.generate(PROMPT, max_new_tokens=24)
    assert len(blend_lines(tmp_path / "full.log")) == 1 and not blend_lines(tmp_path / "prefix.log")
    assert fused["meta_info"]["prompt_tokens"] == native["meta_info"]["prompt_tokens"]  # separator removed in both
    assert fused["text"] == native["text"]
    with server(tmp_path, "off", "--tiered-blend", "off") as s:
        off = s.generate(PROMPT, max_new_tokens=1)
    assert off["meta_info"]["prompt_tokens"] > native["meta_info"]["prompt_tokens"]  # the separator is text
