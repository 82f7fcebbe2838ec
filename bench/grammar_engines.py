"""Grammar engines for structured output: compile time, mask cost per step, masks on the wire.

llguidance, xgrammar and outlines-core on the default model's tokenizer (SmolLM2, 49,152 tokens)
and four grammars: a JSON schema, a regex, a choice list, any JSON object (compact JSON for all).
A step, for `--batch` requests: advance each by one token, then fill all next masks into one
[batch, vocab/32] int32 bitmask; CPU time, one thread. Tokens are valid documents as the tokenizer
writes them (`doc`), or drawn from the mask by a fixed RNG, 128 at most a request (`random`); a
finished request restarts. Then: mask bytes per step if the scheduler sent them, and the cost of
applying a packed bitmask to logits in torch.

    .venv/bin/python bench/grammar_engines.py --steps 100 --batch 64 --json grammar.json

Prints tables; --json writes the same numbers. Never a timed test: numbers are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.model_source import resolve_model  # noqa: E402
from common.tokenizer import load_tokenizer  # noqa: E402

SCHEMA = """{"type": "object", "additionalProperties": false, "properties": {
  "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
  "email": {"type": "string", "format": "email"},
  "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
  "tags": {"type": "array", "items": {"type": "string"}},
  "address": {"type": "object", "additionalProperties": false, "required": ["city", "zip"],
    "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
  "active": {"type": "boolean"}, "score": {"type": "number"}},
  "required": ["name", "age", "role", "tags", "address", "active"]}"""
REGEX = r"[A-Z][a-z]{1,11} [A-Z][a-z]{1,11} <[a-z]{2,10}@[a-z]{2,8}\.(com|org|net)> [0-9]{4}"
CHOICES = ["positive", "negative", "neutral", "mixed", "not applicable", "strongly positive"]
GRAMMARS = {  # name: (form, text); a choice list is a regex for every engine
    "json_schema": ("json", SCHEMA),
    "regex": ("regex", REGEX),
    "choice": ("regex", "(" + "|".join(re.escape(c) for c in CHOICES) + ")"),
    "json_object": ("json", '{"type": "object"}'),
}
WORDS = "alpha bravo delta echo golf hotel india kilo lima mike oscar papa romeo tango".split()
MAX_RANDOM_TOKENS = 128


def document(kind: str, rng: random.Random) -> str:
    """A valid output for grammar `kind`, written the way a model would (compact JSON)."""
    w = lambda: rng.choice(WORDS)  # noqa: E731
    if kind == "regex":
        return f"{w().title()} {w().title()} <{w()}@{w()}.net> {rng.randint(0, 9999):04d}"
    if kind == "choice":
        return rng.choice(CHOICES)
    if kind == "json_schema":
        doc: dict = {"name": f"{w().title()} {w().title()}", "age": rng.randint(18, 90)}
        doc |= {"email": f"{w()}.{w()}@example.com"} if rng.random() < 0.7 else {}
        doc |= {
            "role": rng.choice(["admin", "editor", "viewer"]),
            "tags": [w(), w()][: rng.randint(0, 2)],
        }
        doc |= {"address": {"city": w().title(), "zip": f"{rng.randint(0, 99999):05d}"}}
        doc |= {"active": rng.random() < 0.5}
        doc |= {"score": round(rng.uniform(0, 100), 2)} if rng.random() < 0.5 else {}
        return json.dumps(doc, separators=(",", ":"))

    def value(depth: int):  # nested at most 3 deep: outlines-core's regex for any object
        r = rng.random()
        if depth < 3 and r < 0.3:
            items = [value(depth + 1) for _ in range(rng.randint(1, 3))]
            return items if r < 0.15 else {w(): item for item in items}
        return rng.choice([w(), rng.randint(-999, 99999), round(rng.uniform(-9, 9), 3), True, None])

    return json.dumps({w(): value(1) for _ in range(rng.randint(2, 6))}, separators=(",", ":"))


@dataclass(slots=True)
class Engine:
    compile: Callable  # (form, text) -> compiled grammar
    start: Callable  # compiled -> a new request's matcher
    advance: Callable  # (matcher, token) -> None
    fill: Callable  # (matchers, int32 bitmask [batch, vocab/32]) -> None: row i for matcher i


def llguidance(tok, eos: int) -> Engine:
    import llguidance as llg
    import llguidance.numpy as lnp

    executor = llg.LLExecutor(num_threads=1)
    tokenizer = llg.LLTokenizer(tok.backend.to_str(), eos_token=eos)

    def compile(form: str, text: str):
        compact = {"whitespace_flexible": False}
        if form == "json":
            grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=compact)
        else:
            grammar = llg.grammar_from("regex", text)
        matcher = llg.LLMatcher(tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def fill(seqs, bitmask):
        lnp.fill_next_token_bitmask_par(executor, [(s, i) for i, s in enumerate(seqs)], bitmask)

    return Engine(compile, lambda m: m.deep_copy(), lambda m, t: m.consume_token(t), fill)


def xgrammar(tok, eos: int) -> Engine:
    import xgrammar as xgr

    special = {i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special}
    # special tokens spelled "" are special to xgrammar (never allowed inside a string)
    size = tok.backend.get_vocab_size()
    vocab = ["" if i in special else tok.backend.id_to_token(i) for i in range(size)]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, stop_token_ids=[eos])
    compiler, batch = xgr.GrammarCompiler(info, max_threads=1), xgr.BatchGrammarMatcher(1)

    def compile(form: str, text: str):
        if form == "json":
            return compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"))
        return compiler.compile_regex(text)

    start, advance = xgr.GrammarMatcher, lambda m, t: m.accept_token(t)
    return Engine(compile, start, advance, batch.batch_fill_next_token_bitmask)


def outlines_core(tok, eos: int) -> Engine:
    import outlines_core as oc

    special = {i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special}
    by_bytes: dict[bytes, list[int]] = {}
    for i, piece in enumerate(tok.byte_pieces().pieces):
        if i not in special and piece:
            by_bytes.setdefault(piece, []).append(i)
    vocabulary = oc.Vocabulary(eos, by_bytes)

    def compile(form: str, text: str):  # any object: a regex nested 3 levels deep
        regex = oc.json_schema.build_regex_from_schema(text, "") if form == "json" else text
        return oc.Index(regex, vocabulary)

    def fill(seqs, bitmask):
        row = bitmask.shape[1]
        for i, s in enumerate(seqs):
            s.write_mask_into(bitmask.ctypes.data + 4 * row * i, row, 4)

    return Engine(compile, oc.Guide, lambda m, t: m.advance(t, return_tokens=False), fill)


ENGINES = {  # module: (engine, the form of its mask)
    "llguidance": (llguidance, "bitmask: fill_next_token_bitmask_par (numpy), or bytes"),
    "xgrammar": (xgrammar, "bitmask: batch_fill_next_token_bitmask (any DLPack array)"),
    "outlines_core": (outlines_core, "bitmask: write_mask_into (a pointer), or token list"),
}


def imports_without_torch(module: str) -> bool:
    code = f"import sys; sys.modules['torch'] = None; import {module}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def pct(values: list, q: float):
    return sorted(values)[int(q * (len(values) - 1))]


def run_steps(engine, compiled, kind, mode, docs, batch, steps, eos) -> tuple[np.ndarray, dict]:
    """`steps` steps of `batch` requests: advance each by one token, then fill the next masks.
    Timed in CPU time of this process (the machine is shared), sampling left out."""
    rng, vocab = random.Random(7), 49152
    tokens_of = lambda: [*docs.encode(document(kind, rng), add_special_tokens=False).ids, eos]  # noqa: E731
    seqs = [engine.start(compiled) for _ in range(batch)]
    plans = [tokens_of() if mode == "doc" else [] for _ in range(batch)]
    done, rejected = [0] * batch, 0
    bitmask = np.full((batch, vocab // 32), -1, dtype=np.int32)
    engine.fill(seqs, bitmask)
    times, counts, lists, smaller, zipped, zip_s = [], [], [], [], [], []
    for _ in range(steps):
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        allowed = bits.sum(axis=1)
        counts += allowed.tolist()
        lists.append(4 * int(allowed.sum()))
        # per request the smallest of: allowed ids, disallowed ids (int32 each), bitmask
        least = np.minimum(np.minimum(4 * allowed, 4 * (vocab - allowed)), vocab // 8)
        smaller.append(int(least.sum()))
        t = time.process_time()
        zipped.append(len(zlib.compress(bitmask.tobytes(), 1)))
        zip_s.append(time.process_time() - t)
        chosen, restart = [], []
        for i in range(batch):
            if mode == "doc" and bits[i, plans[i][done[i]]]:
                token = plans[i][done[i]]
            else:
                rejected += mode == "doc"
                token = rng.choice(np.flatnonzero(bits[i]).tolist() or [eos])
            done[i] += 1
            chosen.append(token)
            over = done[i] >= (len(plans[i]) if mode == "doc" else MAX_RANDOM_TOKENS)
            restart.append(token == eos or over)
        t = time.process_time()
        for i, token in enumerate(chosen):
            if restart[i]:  # finished: a new request takes its place
                seqs[i] = engine.start(compiled)
            else:
                engine.advance(seqs[i], token)
        engine.fill(seqs, bitmask)
        times.append(time.process_time() - t)
        for i in range(batch):
            if restart[i]:
                plans[i], done[i] = (tokens_of() if mode == "doc" else []), 0
    step = {"ms": ms(statistics.fmean(times)), "p99 ms": ms(pct(times, 0.99))}
    step |= {"us/req": round(statistics.fmean(times) / batch * 1e6, 1)}
    step |= {"allowed p50": pct(counts, 0.5), "allowed p99": pct(counts, 0.99)}
    step |= {"rejected": rejected}
    wire = {"bitmask": batch * vocab // 8, "lists": round(statistics.fmean(lists))}
    wire |= {"lists max": max(lists), "adaptive": round(statistics.fmean(smaller))}
    wire |= {"adaptive max": max(smaller), "zlib": round(statistics.fmean(zipped))}
    wire |= {"zlib max": max(zipped), "zlib ms": ms(statistics.fmean(zip_s))}
    return bitmask, step | {"wire": wire}


def torch_apply(bitmask: np.ndarray, reps: int = 100) -> list[dict]:
    """A worker applying a packed [batch, vocab/32] bitmask to float32 logits: CPU ms, 1 thread."""
    import torch
    import xgrammar as xgr

    torch.set_num_threads(1)
    mask, shifts = torch.from_numpy(bitmask), torch.arange(32, dtype=torch.int32)
    logits = torch.randn(mask.shape[0], mask.shape[1] * 32)
    unpack = lambda: np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")  # noqa: E731
    ids = [torch.from_numpy(a) for a in np.nonzero(unpack())]  # (rows, token ids)

    def allowed_list_index_put():
        bias = torch.full_like(logits, float("-inf"))
        bias[ids] = 0.0
        logits.add_(bias)

    methods = {
        "bitmask: torch shifts + masked_fill_": lambda: logits.masked_fill_(
            ((mask.unsqueeze(-1) >> shifts) & 1).view(mask.shape[0], -1) == 0, float("-inf")
        ),
        "bitmask: np.unpackbits + masked_fill_": lambda: logits.masked_fill_(
            ~torch.from_numpy(unpack().view(bool)), float("-inf")
        ),
        "bitmask: xgrammar apply_token_bitmask_inplace (C++)": lambda: (
            xgr.apply_token_bitmask_inplace(logits, mask)
        ),
        f"allowed lists ({ids[1].numel():,} ids): index_put_ + add_": allowed_list_index_put,
    }
    rows = []
    for name, fn in methods.items():
        fn()
        times = []
        for _ in range(reps):
            t = time.process_time()
            fn()
            times.append(time.process_time() - t)
        row = {"method": name, "torch": torch.__version__, "ms": ms(statistics.fmean(times))}
        rows.append(row | {"p99 ms": ms(pct(times, 0.99))})
    return rows


def table(title: str, rows: list[dict]) -> Table:
    t = Table(title=title)
    for key, value in rows[0].items():
        t.add_column(key, justify="left" if isinstance(value, str) else "right")
    for row in rows:
        t.add_row(*(f"{v:,}" if type(v) is int else str(v) for v in row.values()))
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    tok = load_tokenizer(resolve_model(None))
    eos = tok.backend.token_to_id(tok.special_tokens["eos_token"])
    report: dict = {"batch": args.batch, "steps": args.steps, "engines": [], "compile": []}
    report |= {"step": [], "wire": [], "loadavg_before": os.getloadavg()}
    engines: dict = {}
    work = [(e, k, m) for e in ENGINES for k in GRAMMARS for m in ("doc", "random")]
    for name, kind, mode in (bar := tqdm(work, desc="engine x grammar x tokens")):
        bar.set_postfix_str(f"{name} {kind} {mode}")
        if name not in engines:
            make, form = ENGINES[name]
            t = time.process_time()
            engines[name] = {"": make(tok, eos)}
            row = {"engine": name, "tokenizer ms": ms(time.process_time() - t)}
            row |= {"version": version(name.replace("_", "-")), "mask": form}
            report["engines"].append(row | {"no torch": imports_without_torch(name)})
        engine, compiled = engines[name][""], engines[name]
        if kind not in compiled:
            t = time.process_time()
            compiled[kind] = engine.compile(*GRAMMARS[kind])
            engine.start(compiled[kind])
            cold, t = time.process_time() - t, time.process_time()
            engine.start(compiled[kind])
            row = {"engine": name, "grammar": kind, "cold ms": ms(cold)}
            report["compile"].append(row | {"warm ms": ms(time.process_time() - t)})
        run = (engine, compiled[kind], kind, mode, tok.backend, args.batch, args.steps, eos)
        bitmask, step = run_steps(*run)
        wire = step.pop("wire")
        report["step"].append({"engine": name, "grammar": kind, "tokens": mode} | step)
        if name == "llguidance":  # the masks are the same whichever engine computes them
            report["wire"].append({"grammar": kind, "tokens": mode} | wire)
            if kind == "json_schema" and mode == "random":
                apply_mask = bitmask  # mostly inside strings: long allowed lists
    report["torch_apply"] = torch_apply(apply_mask)
    report["loadavg_after"] = os.getloadavg()
    n, console = args.batch, Console()
    for title, rows in (
        ("engines (tokenizer ms: building the engine's vocabulary)", report["engines"]),
        ("compile, CPU ms: cold (first) and warm (a new request on it)", report["compile"]),
        (f"one step of {n} constrained requests: CPU ms, 1 thread", report["step"]),
        (f"scheduler -> worker: bytes of the masks of {n} requests per step", report["wire"]),
        (f"worker: apply to [{n}, 49152] logits: CPU ms, 1 thread", report["torch_apply"]),
    ):
        console.print(table(title, rows))
    console.print(f"load average: {report['loadavg_before']} -> {report['loadavg_after']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
