"""Blending of stored chunk KV in a real SGLang server (CPU, the embedded SmolLM2, `--tiered-blend blend`).

The answer needs facts from two chunks ("Alice works at the Amber Museum." / "The Amber Museum is in Lisbon.").
1. first request: both chunks are new -> standalone KV computed and stored, then blended; the answer names Lisbon;
2. the same prompt again: a prefix hit on the blended KV, kept in the radix tree under the blend namespace, the same
   answer; the same documents through /v1/chat/completions (separators in the user message) hit it too; blended KV
   is invisible to the same tokens sent unmarked and to another tenant, and a follow-up turn hits it;
3. after a restart on the stored chunk files: chunk KV is read from SSD, same answer;
4. chunk pages corrupted on disk: the request falls back to SGLang's normal prefill (logged, counted), answered;
5. marked requests sent together with plain ones each prefill alone and are all blended (counted in /metrics, no
   fallback); with chunked prefill in 128-token pieces a prompt is blended piece by piece; with --enable-mixed-chunk
   a marked request that shares its forward with decode rows gets a normal prefill, logged and counted;
and `--tiered-blend full` (the blend machinery, every token recomputed) in fp32 equals SGLang's own prefill exactly
(`--tiered-blend off`, which leaves the separator in the text: tests/integration/test_torch_native.py).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_tiered.server_process import ServerProcess, cached_details, metric_total
from tests.integration.helpers import SEP, copy_tree, tiered_args

FILLER = "The weather was mild that spring and the gardens along the river were full of visitors. " * 3
CHUNK_A = "Alice works at the Amber Museum. " + FILLER
CHUNK_B = FILLER + "The Amber Museum is in Lisbon."
SYSTEM = "Answer the question using the documents."
QUESTION = "\nQuestion: In which city does Alice work?"
HEAD = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"  # SmolLM2's chat template, written out
TAIL = f"{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
PROMPT = HEAD + SEP + CHUNK_A + SEP + CHUNK_B + SEP + TAIL
PIECE = 128  # --chunked-prefill-size of the pieces server: PROMPT (150 tokens) is prefilled in two pieces


pytestmark = [pytest.mark.server, pytest.mark.slow]


def server(tmp: Path, name: str, *extra: str) -> ServerProcess:
    return ServerProcess(tiered_args(tmp / "ssd", *extra, max_tokens=2048), log_path=tmp / f"{name}.log")


def blend_lines(server: ServerProcess, since: int = 0) -> list[str]:
    return server.log_lines("tiered blend: rid", since)


def marked_ids(tok, parts: list[str]) -> tuple[list[int], list[int]]:
    """`parts` tokenized one by one by `tok`, as the separator split does: (the prompt's ids, the part lengths)."""
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in parts]
    return sum(ids, []), [len(x) for x in ids]


def ask_ids(s: ServerProcess, input_ids: list[int], chunks: list[int] | None, salt: str | None = None,
            new: int = 12) -> dict:
    """Greedy /generate of `input_ids`, marked with the part lengths `chunks` (None: unmarked)."""
    params: dict = {"max_new_tokens": new, "temperature": 0}
    if chunks is not None:
        params["custom_params"] = {"tiered_chunks": chunks}
    body: dict = {"input_ids": input_ids, "sampling_params": params}
    if salt is not None:
        body["cache_salt"] = salt
    status, out = s.request("/generate", body)
    assert status == 200, out
    return out


def test_answer_from_two_chunks_then_from_the_store_and_from_ssd(tmp_path, shared_server):
    s = shared_server
    mark = s.log_mark()
    first = s.generate(PROMPT, max_new_tokens=16)
    again = s.generate(PROMPT, max_new_tokens=16)
    chat = json.loads(s.post("/v1/chat/completions", {
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": SEP + CHUNK_A + SEP + CHUNK_B + SEP + QUESTION}],
        "max_tokens": 16, "temperature": 0}))
    assert "Lisbon" in first["text"], first["text"]
    assert again["text"] == first["text"]
    assert again["meta_info"]["cached_tokens"] >= 2 * 64  # the blended KV of its first two pages, from the tree
    lines = blend_lines(s, mark)
    assert len(lines) == 3, lines
    assert "chunks=3 (new 3)" in lines[0] and "extend=[128," in lines[1], lines
    # the default selection: the first 32 tokens of each chunk on every layer, the rest of each chunk reused
    assert "select=position" in lines[0], lines[0]
    assert 0.0 < float(re.search(r"computed=(\d\.\d+)", lines[0]).group(1)) < 1.0, lines[0]
    namespace = next(s.ssd.glob("*/NAMESPACE.json")).parent  # chunk KV lives in the server's one SSD tier:
    chunks = namespace / "chunks"  # one file per chunk, a segment per layer
    deadline = time.monotonic() + 30  # written through on a background thread
    while len(list(chunks.rglob("*.kvp"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(list(chunks.rglob("*.kvp"))) >= 3, "chunk KV was not written through to SSD"
    assert "Lisbon" in chat["choices"][0]["message"]["content"], chat
    assert "extend=[128," in lines[2], lines  # the chat template rendered the same prompt: the same blended KV

    # a restart: a new server on (a copy of) the stored chunk files; no chunk KV kept in memory, so every
    # request reads it from SSD
    copy_tree(chunks, tmp_path / "ssd" / namespace.name / "chunks")  # the same namespace: model, dtype, pages
    with server(tmp_path, "restart", "--tiered-blend-memory", "0", "--enable-metrics") as r:
        after = r.generate(PROMPT, max_new_tokens=16)
        lines = blend_lines(r)
        assert after["text"] == first["text"]
        assert len(lines) == 1 and "(new 0)" in lines[0] and "'memory': 0, 'ssd': 3" in lines[0], lines

        for page in (tmp_path / "ssd").rglob("chunks/*.kvp"):  # flip a byte in every stored chunk's last layer
            data = bytearray(page.read_bytes())
            data[-5] ^= 0xFF
            page.write_bytes(bytes(data))
        mark = r.log_mark()  # (the chunks in another order: the blended prefix above does not match it)
        fallback = r.generate(HEAD + SEP + CHUNK_B + SEP + CHUNK_A + SEP + TAIL, max_new_tokens=16)
        assert fallback["text"].strip()
        lines = blend_lines(r, mark)
        assert len(lines) == 1 and "runs a normal prefill (chunk KV unavailable" in lines[0], lines
        assert metric_total(r.get("/metrics"), "sglang_tiered:blend_fallbacks_total") == 1


def test_blended_kv_is_kept_in_the_tree_under_its_own_namespace(shared_server, model_dir):
    """A marked prompt sent as token ids with its chunk lengths: an identical repeat (its last partial page blended
    as the first ask's was: the same answer) and follow-up turns hit the blended KV, the follow-ups as SGLang's own
    extend (their match covers every whole page of the chunks); the same ids unmarked, or under another tenant's
    cache_salt, hit none of it; after device and host are flushed the blended pages come back from the SSD tier,
    still in their namespace."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    chunk_c = "Bruno repairs clocks in the Cedar Workshop. " + FILLER
    chunk_d = FILLER + "The Cedar Workshop stands in Oslo, by the harbour."
    question = "\nQuestion: Where does Bruno repair clocks?<|im_end|>\n<|im_start|>assistant\n"
    flat, lengths = marked_ids(tok, [HEAD, chunk_c, chunk_d, question])
    s = shared_server

    def ask(input_ids: list[int], chunks: list[int] | None, salt: str | None = None) -> dict:
        return ask_ids(s, input_ids, chunks, salt)

    pages = (len(flat) - 1) // 64 * 64
    assert pages >= 128, len(flat)
    mark = s.log_mark()
    first = ask(flat, lengths)
    assert first["meta_info"]["cached_tokens"] == 0 and len(blend_lines(s, mark)) == 1
    again = ask(flat, lengths)
    assert again["meta_info"]["cached_tokens"] == pages and again["output_ids"] == first["output_ids"]
    assert len(blend_lines(s, mark)) == 2
    plain = ask(flat, None)  # the same tokens, unmarked: exact requests never see blended KV
    assert plain["meta_info"]["cached_tokens"] == 0
    other = ask(flat, lengths, salt="another-tenant")  # blended anew in that tenant's namespace
    assert other["meta_info"]["cached_tokens"] == 0
    follow = tok("<|im_end|>\n<|im_start|>user\nAnd in which city is that?<|im_end|>\n<|im_start|>assistant\n",
                 add_special_tokens=False)["input_ids"]
    mark = s.log_mark()  # follow-up turns: their match covers every whole page of the chunks (the tree holds whole
    # pages), so SGLang extends them over the blended KV: not blended, no fallback
    turn = flat + first["output_ids"] + follow
    second = ask(turn, lengths[:-1] + [lengths[-1] + len(first["output_ids"]) + len(follow)])
    assert second["meta_info"]["cached_tokens"] >= pages >= sum(lengths[:-1]) // 64 * 64
    turn = turn + second["output_ids"] + follow
    third = ask(turn, lengths[:-1] + [len(turn) - sum(lengths[:-1])])
    assert third["meta_info"]["cached_tokens"] >= sum(lengths[:-1]), third["meta_info"]
    assert not blend_lines(s, mark) and not s.log_lines("runs a normal prefill", mark)
    s.flush_cache()  # device and host emptied: the blended pages come back from SSD, in their namespace only
    deadline = time.monotonic() + 30
    while True:
        stored = ask(flat, lengths)
        if cached_details(stored)["storage"] >= 64 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
        s.flush_cache()
    assert cached_details(stored)["storage"] >= 64 and stored["output_ids"] == first["output_ids"]


def short_rag_prompt(name: str, museum: str, city: str) -> str:
    """Under one 64-token page: SGLang's storage prefetch (which admits requests one by one as each lookup ends)
    does not start, so requests that arrive together are batched together."""
    return (HEAD + SEP + f"{name} works at the {museum} Museum." + SEP + f"The {museum} Museum is in {city}." + SEP
            + f"\nQuestion: In which city does {name} work?<|im_end|>\n<|im_start|>assistant\n")


def test_concurrent_marked_requests_each_prefill_alone_and_are_all_blended(shared_server):
    """Without keeping them apart, SGLang batches requests that arrive together, and blending (one request per
    extend batch) would fall back for every marked request in a shared batch."""
    marked = [short_rag_prompt(*x) for x in (("Alice", "Amber", "Lisbon"), ("Bruno", "Cedar", "Oslo"),
                                              ("Chiara", "Granite", "Quito"), ("Dev", "Harbor", "Lima"))]
    prompts = [*marked, "The gardens along the river", "Museums in Lisbon are"]  # the last two are plain prompts
    s = shared_server
    s.flush_cache()
    before = s.get("/metrics")
    mark = s.log_mark()
    alone = s.generate(marked[0], max_new_tokens=12)
    for _ in range(2):
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda t: s.generate(t, max_new_tokens=12), prompts))
    program = frontend_program(s.url)
    metrics = s.get("/metrics")
    log = "\n".join(s.log_lines(since=mark))
    # requests were waiting while one was admitted: SGLang would have put them in the same batch (the token budget
    # holds them all); without the scheduler hook this test blends 3 of 9 (checked)
    assert re.search(r"Prefill batch, #new-seq: 1, .*#queue-req: [1-9]", log), "no request ever waited: shows nothing"
    lines = blend_lines(s, mark)
    assert not [line for line in lines if "normal prefill" in line], lines

    def delta(name: str) -> float:
        return metric_total(metrics, name) - metric_total(before, name)

    assert delta("sglang_tiered:blend_requests_total") == 10  # 9 + the frontend program
    assert delta("sglang_tiered:blend_fallbacks_total") == 0
    assert outs[0]["text"] == alone["text"]  # the same blend, next to other requests
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


def test_output_logprobs_are_blended_and_prompt_logprobs_fall_back(shared_server):
    """Log-probabilities of the output tokens (SGLang's default for return_logprob) need only the last prompt row:
    the request is blended and its first token is the top-1 of its own top log-probabilities; asking for the prompt
    tokens' log-probabilities too gets SGLang's prefill, logged."""
    s = shared_server
    prompt = short_rag_prompt("Elena", "Juniper", "Porto")
    params = {"max_new_tokens": 4, "temperature": 0}
    mark = s.log_mark()
    status, out = s.request("/generate", {"text": prompt, "return_logprob": True, "top_logprobs_num": 5,
                                          "sampling_params": params})
    assert status == 200, out
    top = out["meta_info"]["output_top_logprobs"][0]
    assert len(top) == 5 and top[0][1] == out["output_ids"][0] and top[0][0] >= top[1][0]
    lines = blend_lines(s, mark)
    assert len(lines) == 1 and "normal prefill" not in lines[0], lines
    mark = s.log_mark()
    status, out = s.request("/generate", {"text": prompt, "return_logprob": True, "logprob_start_len": 0,
                                          "sampling_params": params})
    assert status == 200, out
    assert len(out["meta_info"]["input_token_logprobs"]) == out["meta_info"]["prompt_tokens"]
    lines = blend_lines(s, mark)
    assert len(lines) == 1 and "input logprobs were requested" in lines[0], lines


def test_full_mode_equals_sglang_prefill(fp32_server, model_dir):
    """fp32, `--tiered-blend full`: our engine writing every token's KV of a marked prompt into SGLang's pool gives
    the greedy tokens of SGLang's own prefill of the same ids unmarked."""
    from transformers import AutoTokenizer

    flat, lengths = marked_ids(AutoTokenizer.from_pretrained(model_dir), [HEAD, CHUNK_A, CHUNK_B, TAIL])
    s = fp32_server
    s.flush_cache()
    mark = s.log_mark()
    native = ask_ids(s, flat, None, new=24)
    assert not blend_lines(s, mark)
    s.flush_cache()
    blended = ask_ids(s, flat, lengths, new=24)
    lines = blend_lines(s, mark)
    assert len(lines) == 1 and "mode=full" in lines[0], lines
    assert blended["output_ids"] == native["output_ids"]


@pytest.fixture(scope="module")
def pieces_server(tmp_path_factory) -> Iterator[ServerProcess]:
    """SGLang's prefill in pieces of PIECE tokens, mixed with running decodes where it can (`--enable-mixed-chunk`):
    one server for the two tests below (a request alone in its batch is prefilled piece by piece all the same). Last
    in this module: it lives until the module ends, and no server of a test of its own starts beside it.
    A mixed piece gets what the decodes leave of PIECE, rounded down to whole 64-token pages: PIECE 64 never mixes."""
    tmp = tmp_path_factory.mktemp("pieces")
    args = ("--chunked-prefill-size", str(PIECE), "--enable-mixed-chunk", "--enable-metrics")
    with server(tmp, "pieces", *args) as s:
        yield s


def test_chunked_prefill_is_blended_piece_by_piece(pieces_server):
    s = pieces_server
    mark, before = s.log_mark(), metric_total(s.get("/metrics"), "sglang_tiered:blend_requests_total")
    first = s.generate(PROMPT, max_new_tokens=16)
    metrics = s.get("/metrics")
    lines = blend_lines(s, mark)
    pieces = [tuple(map(int, re.search(r"extend=\[(\d+),(\d+)\)", line).groups())) for line in lines]
    total = first["meta_info"]["prompt_tokens"]
    assert total > PIECE and pieces == [(a, min(a + PIECE, total)) for a in range(0, total, PIECE)], pieces
    new = [int(re.search(r"\(new (\d+)\)", line).group(1)) for line in lines]
    assert sum(new) == 3 and new[0] >= 1, lines  # every chunk's KV computed once, in the piece that first meets it
    assert first["text"].strip()
    assert "reused=0 " in lines[-1], lines[-1]  # the last piece is the prompt's last partial page: computed fresh
    assert metric_total(metrics, "sglang_tiered:blend_requests_total") - before == 1  # a request, not a piece


def test_a_marked_request_in_a_mixed_batch_falls_back_counted(pieces_server):
    """With --enable-mixed-chunk SGLang puts a new prefill next to running decodes: blending (one request per forward)
    cannot run, the marked request gets SGLang's normal prefill, logged and counted, and is still answered."""
    s = pieces_server
    mark, before = s.log_mark(), metric_total(s.get("/metrics"), "sglang_tiered:blend_fallbacks_total")
    with ThreadPoolExecutor(1) as pool:
        decoding = pool.submit(s.generate, "The gardens along the river", 120)  # decodes for seconds
        deadline = time.monotonic() + 60
        while not s.log_lines("Decode batch", mark):
            assert time.monotonic() < deadline, "the plain request never decoded"
            time.sleep(0.2)
        marked = s.generate(PROMPT, max_new_tokens=8)
        assert decoding.result()["text"].strip()
    metrics = s.get("/metrics")
    lines = blend_lines(s, mark)
    assert marked["text"].strip()
    assert any("runs a normal prefill (its prefill batch holds 2 requests)" in line for line in lines), lines
    assert metric_total(metrics, "sglang_tiered:blend_fallbacks_total") - before >= 1
