"""The `localllm` command."""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
from pathlib import Path

import torch

from . import atomic
from .errors import LocalLLMError
from .quant import BASE_BITS, GROUP_SIZES, HEAD_BITS, HEAD_WIDTHS

DEFAULT_EVAL_QDEC = "off,approx"


def _qdec_arg(s: str):
    if s in ("on", "off"):
        return s
    try:
        k = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--qdec takes on, off or a k_chunk integer, not {s!r}") from None
    if k < 0:  # (the model's own upper bound, its calibration's, is checked once it loads)
        raise argparse.ArgumentTypeError(f"--qdec {k}: a k_chunk is channels per 1024, 0 (off) or more")
    return k


def _whole_arg(name: str, lo: int, hi: int | None = None):
    """An argparse type: a whole number within lo..hi (no upper bound without hi)."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            v = None
        if v is None or v < lo or hi is not None and v > hi:
            within = f"from {lo} to {hi}" if hi is not None else f"of at least {lo}"
            raise argparse.ArgumentTypeError(f"{name} takes a whole number {within}, not {s!r}")
        return v
    return parse


def cmd_generate(a) -> None:
    from .generate import generate
    from .loader import exists
    from .runtime import load
    if len(a.args) > 2:
        raise LocalLLMError(f"generate takes [MODEL] PROMPT, got {len(a.args)} arguments: quote the prompt "
                            "(localllm generate MODEL \"a prompt of several words\")")
    model, prompt = (None, a.args[0]) if len(a.args) == 1 else a.args
    from .sampling import SamplingParams  # the options' own refusals before the model loads (seconds to minutes)
    SamplingParams(a.temperature, a.top_p, a.top_k, a.repetition_penalty, a.min_p).check()
    if a.max_new_tokens < 1:
        raise LocalLLMError(f"--max-new-tokens must be at least 1, got {a.max_new_tokens}")
    if prompt == "-" and sys.stdin is None:
        raise LocalLLMError("standard input is closed: pipe the prompt in, or give it as an argument")
    if prompt == "-":  # the prompt from standard input: `cat notes.txt | localllm generate MODEL -`
        if sys.stdin.isatty():
            print("localllm: reading the prompt from the terminal: end it with Ctrl+D", file=sys.stderr)
        # (bytes that are not UTF-8 as lone surrogates, whatever the locale: generate refuses them in one line)
        prompt = sys.stdin.buffer.read().decode("utf-8", "surrogateescape")
        prompt = prompt[:-1] if prompt.endswith("\n") else prompt  # (echo's newline: --raw continues the text)
        if not prompt.strip():
            raise LocalLLMError("the prompt from standard input (-) is empty: pipe some text in")
    elif not prompt.strip():
        raise LocalLLMError("the prompt is empty: give some text (or - to read it from standard input)")
    elif model is None and len(prompt.split()) == 1 and exists(prompt):
        raise LocalLLMError(f"generate got one argument, {prompt!r}, which is a path: give the prompt too "
                            f"(localllm generate {prompt} \"PROMPT\")")
    # untuned QDEC on a GPU stays so for a one-off reply (tuning would take longer); the summary line says so
    lm = load(model, gguf_file=a.gguf_file, device=a.device, qdec=a.qdec, budget=a.budget, kv_bits=a.kv_bits,
              prefill_int8=a.prefill_int8, tune=False)
    if a.qdec != "off" and not lm.has_residuals:
        print(f"localllm: {lm.path} {_uncompensated(lm)}; generating without compensation", file=sys.stderr)
    use_chat = not a.raw and getattr(lm.tokenizer, "chat_template", None)
    if not a.raw and not use_chat:  # (a base model; or an instruct model's folder that lost its template)
        print(f"localllm: {lm.path} has no chat template: the prompt is continued as plain text, as with --raw"
              + ("; --system is not used" if a.system else ""), file=sys.stderr)
    elif a.system and a.raw:
        print("localllm: --system needs the model's chat template, which --raw turns off: the system prompt is not "
              "used", file=sys.stderr)
    msgs = ([{"role": "system", "content": a.system}] if a.system else []) + [{"role": "user", "content": prompt}]
    if lm.model.device.type == "cpu":  # the weights' CPU form now (with its bar): "first token" then times the prompt
        lm.model.make_ready()
    s = generate(lm, msgs if use_chat else prompt, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                 top_p=a.top_p, top_k=a.top_k, repetition_penalty=a.repetition_penalty, min_p=a.min_p, stop=a.stop,
                 seed=a.seed, stream=True)
    try:
        for piece in s:
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:  # the reply so far ends its line, and the numbers say how it ended
        s.close()
        _reply_done(lm, s)
        raise
    _reply_done(lm, s)


def _uncompensated(lm) -> str:
    """Why a model has nothing for QDEC to run."""
    return "is not quantized (a dense checkpoint)" if lm.manifest is None else "has no QDEC residuals"


def _reply_done(lm, s) -> None:
    sys.stdout.write("\n")
    sys.stdout.flush()
    st = s.stats
    first = f"first token {st.time_to_first_token:.2f} s" if st.new_tokens else "no token"  # (stopped in the prompt)
    print(f"[{st.counts()}, {first}, "
          f"finished by {st.finish_reason}; "
          + lm.qdec_summary()
          + f"; KV cache {lm.kv_bits}-bit" + ("; prompt 8-bit activations" if lm.settings.act8 else "") + "]",
          file=sys.stderr)


def cmd_chat(a) -> None:
    from .devices import resolve_device
    from .tui.session import ReplySettings
    device = str(resolve_device(a.device))  # no GPU for --device cuda: the one-line error, before the app starts
    resume = None
    if a.resume is not None:  # a file that is not a saved chat: one line here, before the app starts
        from .tui import history
        resume = history.load(a.resume)
    system = a.system if a.system is not None else resume["system"] if resume else ""
    settings = ReplySettings(system=system, temperature=a.temperature, top_p=a.top_p, min_p=a.min_p, top_k=a.top_k,
                             repetition_penalty=a.repetition_penalty, max_new_tokens=a.max_new_tokens, seed=a.seed)
    settings.check()
    save_dir = Path(a.save_dir).expanduser()  # found now, not at the first Ctrl+S after a long chat
    if not save_dir.is_dir():
        raise LocalLLMError(f"--save-dir {a.save_dir} is not a folder: create it or pass an existing one")
    atomic.check_writable(save_dir / "chat.json", "pass a --save-dir you can write (Ctrl+S saves the chat there)")
    if a.model is not None:  # a mistyped path, or one of no model: one line here; what goes wrong while loading
        from .loader import check_source  # shows in the app
        check_source(a.model, kind=True, gguf_file=a.gguf_file)
    from .tui.app import ChatApp
    app = ChatApp(a.model, gguf_file=a.gguf_file, device=device, qdec=a.qdec, budget=a.budget, settings=settings,
                  save_dir=a.save_dir, kv_bits=a.kv_bits, prefill_int8=a.prefill_int8, tune=not a.no_tune,
                  resume=resume)
    app.run()
    if app.working:  # the exit waits for them: say why the terminal is not back yet
        print("localllm: stopping: the model's work ends at its next step (a layer of a long prompt on the CPU, or a "
              "step of loading)", file=sys.stderr)
    if app.load_error:  # shown in the app; here too, and in the exit status, for whoever ran it
        raise LocalLLMError(f"could not load {a.model or 'the demo model'}: {app.load_error}")


def cmd_info(a) -> None:
    from .runtime import info
    d = info(a.model, gguf_file=a.gguf_file)
    if a.json:
        print(json.dumps(d, indent=2))
        return
    from .devices import size
    print(f"model        {d['path']}")
    print(f"             {d['architecture']}, {d['parameters'] / 1e6:.1f}M parameters")
    h = d["head"]
    print(f"bits         {d['quantization']}; output head " + (f"{h['bits']}-bit, group {h['group_size']}" if h else "fp16"))
    if d["awq"]:  # what AWQ's scales bought over RTN, on the calibration inputs
        err = [f"{k} {v['mean_error_vs_rtn']:.3f}" for k, v in d["awq"].items() if v["mean_error_vs_rtn"] is not None]
        kept = sum(v["rtn_blocks"] for v in d["awq"].values())
        print("awq          " + (f"output error over RTN's, mean over blocks: {', '.join(err)}; " if err else "")
              + f"{kept} of {sum(v['blocks'] for v in d['awq'].values())} projections kept RTN (alpha 0)")
    print(f"GPU memory   {size(d['gpu_bytes'])} (weights, without KV cache)")
    print(f"pinned host  {size(d['pinned_host_bytes'])} (QDEC residuals) + {size(d['pinned_embed_bytes'])} (embeddings, on a "
          "GPU)")
    print(f"CPU memory   {size(d['cpu_bytes'])} (on a machine without a GPU: the weights as float32"
          + (", the QDEC residuals" if d["pinned_host_bytes"] else "") + ")"
          + (f", or {size(d['cpu_unpacked_bytes'])} where that does not fit (their codes unpacked, slower)"
             if d["cpu_unpacked_bytes"] != d["cpu_bytes"] else ""))
    kv, sa = d["kv_cache"], d["kv_cache"]["smooth_attention"]
    per_token = ", ".join(f"{n / 2**10:.1f} KiB at {b} bits" for b, n in kv["bytes_per_token"].items())
    cpu16 = kv["cpu_bytes_per_token_16"] / 2**10
    print(f"KV cache     per token {per_token} (16 bits on the CPU, float32: {cpu16:.1f} KiB); SmoothAttention " + (f"alpha {sa['alpha']}" if sa else "none"))
    if d["calibration"]:
        c = d["calibration"]
        print(f"calibration  {c['tokens']} tokens of {c['text']}, k_chunk up to {c['kmax']}")
        v = c.get("qdec_value")
        if v:  # what the tuner spreads a budget by (tuner.search.allocate)
            taken = ", ".join(f"{k} {kl - v['off']:+.3f}" for k, kl in v["kl"].items())
            print(f"QDEC value   KL from the source {v['off']:.3f} with QDEC off; each kind at k_chunk {v['k_chunk']} "
                  f"in every block: {taken}")
            if fo := v.get("blocks"):  # quantize's first-order value of each block (tuner.blocks.first_order)
                best = ", ".join(f"{k} {max(range(len(b)), key=lambda i: b[i][fo['k_chunks'].index(v['k_chunk'])])}"
                                 for k, b in fo["kl"].items())
                print(f"             per block to first order, at k_chunk {', '.join(map(str, fo['k_chunks']))}; "
                      f"the most valuable block of each kind: {best}")
    else:
        print("calibration  none")
    if d.get("quantized_on"):
        q = d["quantized_on"]
        print(f"quantized on {q['device']} in {q['seconds'] / 60:.1f} min")
    print(f"source       {d['source'].get('hub_id') or d['source']['path']}"
          + (f"  sha256 {d['source']['sha256'][:16]}" if d['source'].get('sha256') else ""))
    untuned = "no profiles (`localllm tune` makes one on a GPU)" if d["bits"] < 16 else \
        "none (`localllm tune` takes a quantized model)"
    profiles = [f"{name} ({what})" for name, what in d["tuning_profiles"].items()]
    print(f"tuning       {', '.join(profiles) or untuned}")


def cmd_quantize(a) -> None:
    from .quantize import quantize
    out = quantize(a.source, a.output, bits=a.bits, group_size=a.group_size, residuals=not a.no_residuals,
                   calib_text=a.calib_text, calib_tokens=a.calib_tokens, gguf_file=a.gguf_file, method=a.method,
                   smooth_attention=not a.no_smooth_attention, head_bits=a.head_bits, device=a.device)
    print(f"wrote {out}")


def cmd_eval(a) -> None:
    from .evaluate import (PAIR_BLOCK, Reference, load_source, paired_change, paired_kl_change, read_text,
                           source_path, sweep, tokenize)
    from .loader import check_source
    from .model import QDEC_MODES
    from .devices import resolve_device
    from .runtime import load
    modes = [m.strip() for m in (DEFAULT_EVAL_QDEC if a.qdec is None else a.qdec).split(",") if m.strip()]
    bad = [m for m in modes if m not in QDEC_MODES]
    if bad or not modes:
        raise LocalLLMError(f"--qdec takes a comma-separated list of {', '.join(QDEC_MODES)}; got {a.qdec!r}")
    ks = list(_ints("--k-chunk", a.k_chunk))
    if any(k < 1 for k in ks):
        raise LocalLLMError(f"--k-chunk values are channels per 1024, at least 1; got {a.k_chunk!r} (--qdec off "
                            "measures no compensation)")
    if not ks and any(m != "off" for m in modes):
        raise LocalLLMError("--k-chunk is empty; QDEC modes other than off need at least one value, e.g. 8")
    if a.max_tokens is not None and a.max_tokens < 2:
        raise LocalLLMError(f"--max-tokens must be at least 2 (perplexity predicts each token from those before it), "
                            f"got {a.max_tokens}")
    if a.ctx is not None and a.ctx < 2:  # (its upper bound, the model's context, is checked once it loads)
        raise LocalLLMError(f"--ctx must be within 2..the model's context; got {a.ctx}")
    if a.prefill_int8 and resolve_device(a.device).type != "cpu":  # ("auto" without a GPU: the CPU)
        raise LocalLLMError("eval measures --prefill-int8 on the CPU only: add --device cpu (the GPU's int8 prompt "
                            "path computes the same function)")
    text, name = read_text(a.text)  # the cheap checks before the model loads
    if a.reference not in (None, "source"):
        check_source(a.reference)
    lm = load(a.model, gguf_file=a.gguf_file, qdec="off", device=a.device, kv_bits=a.kv_bits,
              prefill_int8=a.prefill_int8)
    if a.qdec is None and not lm.has_residuals:  # the default modes: what this model can run
        print(f"localllm: {lm.path} {_uncompensated(lm)}; evaluating with QDEC off only", file=sys.stderr)
        modes = ["off"]
    ids = tokenize(lm, text, a.max_tokens)
    reference = None
    if a.reference is not None:
        ref_path = a.reference
        if ref_path == "source":
            src = source_path(lm)
            if not src:
                raise LocalLLMError(f"{lm.path} records no source checkpoint: give --reference PATH")
            if not Path(src).expanduser().exists():
                raise LocalLLMError(f"the source checkpoint recorded in {lm.path} ({src}) is not on this machine: "
                                    "give --reference PATH")
        reference = Reference(load_source(lm, a.device) if ref_path == "source" else
                              load(ref_path, qdec="off", device=a.device), lm)
    ctx = a.ctx if a.ctx is not None else min(512, lm.model.cfg.max_position_embeddings)
    rows = sweep(lm, ids, modes, ks, ctx=ctx, seed=a.seed, reference=reference)
    base = next((r for r in rows if r.mode == "off"), None)
    print(f"perplexity of {name}: {len(ids) - 1} predicted tokens, windows of {ctx}, {lm.kv_bits}-bit KV cache, "
          f"{lm.path}" + (f"; KL divergence from {reference.lm.path}" if reference else ""))
    # vs off: the change in perplexity and its 95% interval (the same tokens, compared token by token)
    print(f"{'QDEC':8} {'k_chunk':>7} {'perplexity':>11}" + (f" {'vs off (95%)':>16}" if base else "")
          + (f" {'KL':>8}" + (f" {'vs off (95%)':>16}" if base else "") if reference else ""))
    short = False
    for r in rows:
        line = f"{r.mode:8} {r.k_chunk:7d} {r.perplexity:11.4f}"
        if base is r:  # the row the others are compared with
            line += f" {'':>16}"
        elif base:
            change, half = paired_change(r.losses, base.losses, window=ctx)
            line += _change_cells(change, half, 2)
            short = short or half is None
        if reference:
            line += f" {r.kl:8.4f}"
            if base and base is not r:
                line += _change_cells(*paired_kl_change(r.kls, base.kls, window=ctx), 1)
        print(line)
    if short:
        print(f"(±-: no interval under {2 * PAIR_BLOCK} predicted tokens, as it comes from blocks of {PAIR_BLOCK})")
    if any(math.isnan(r.perplexity) for r in rows):  # not a number to compare, and a table would not say why
        print("localllm: warning: the model's outputs hold NaN (its weights, or its source's, hold NaN or inf): "
              "check the source with `localllm eval SOURCE --qdec off`, and re-download or re-quantize it",
              file=sys.stderr)


def _change_cells(change: float, half: float | None, digits: int) -> str:
    """An eval row's change from off and its 95% interval's half-width (±-: none, under two blocks)."""
    return f" {change:+7.{digits}f}% {'±' + ('-' if half is None else f'{half:.{digits}f}'):>7}"


def cmd_bench(a) -> None:
    from .bench import main as bench_main
    bench_main(a.parts, kv_bits=a.kv_bits)


def _budget_arg(s: str) -> float:
    from .tuner.profile import parse_budget
    try:
        return parse_budget(s)
    except LocalLLMError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_tune(a) -> None:
    from .kernels import cuda
    from .tuner.profile import parse_budgets
    budgets = parse_budgets(a.budget)  # the arguments' own errors first, also on a machine without a GPU
    if a.tokens < 2:
        raise LocalLLMError(f"--tokens must be at least 2 (perplexity needs a token to predict); got {a.tokens}")
    if a.model is not None:  # what the model folder lacks before what the machine lacks
        from .loader import exists
        from .modelfile import read_manifest
        from .tuner.tune import no_residuals
        path = Path(a.model).expanduser()
        if not exists(path):  # (False too for a name longer than file systems hold, where .exists() raises)
            raise LocalLLMError(f"no such file or folder: {path}; localllm tune takes a model folder that `localllm "
                                "quantize` wrote")
        if not read_manifest(path).get("residual"):  # (a checkpoint, not a quantized model: the fix in one line)
            raise no_residuals(path)
    cuda.require_for("localllm tune times the QDEC kernels on the GPU")
    from .runtime import load
    from .tuner.tune import table, tune
    lm = load(a.model, qdec="off", device="cuda")
    res = tune(lm, budgets, evaluate=not a.no_eval, tokens=a.tokens, force=a.force, reps=a.reps)
    import torch
    print(table(res, f"QDEC tuning of {lm.path} (model {lm.manifest['model_id']}, W{lm.manifest['quant']['bits']}) "
                     f"on {torch.cuda.get_device_name(lm.model.device)}"))
    for path, old in res.paths:
        print(f"{'replaced' if old else 'wrote'} {path}" + (f" (tuned {old.get('created', '?')})" if old else ""))
    if "qdec_value" not in lm.manifest.get("calibration", {}):
        print(f"note: {lm.path} was quantized before localllm measured what QDEC buys per layer type, so this tune "
              "counted residual rows; quantize it again for a budget spent where it buys the most (README, \"QDEC "
              "on a GPU: tuning\")")


_EXAMPLES = {"--bits": "2,3,4", "--k-chunk": "8,32", "--residual-bits": "2,8,16"}


def _ints(flag: str, text: str) -> tuple:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise LocalLLMError(f"{flag} takes comma-separated integers, e.g. {_EXAMPLES[flag]}; got {text!r}") from None


def cmd_report(a) -> None:
    from .report import Options, make_report
    from .tuner.profile import parse_budgets
    sections = tuple(s.strip() for s in a.sections.split(",") if s.strip()) if a.sections is not None else None
    o = Options(model=a.model, out=a.out, tokens=a.tokens, ctx=a.ctx, bits=_ints("--bits", a.bits),
                k_chunks=_ints("--k-chunk", a.k_chunk), compare_bits=a.compare_bits,
                residual_bits=_ints("--residual-bits", a.residual_bits), group_size=a.group_size,
                budgets=tuple(parse_budgets(a.budget)), sections=sections, seed=a.seed, text=a.text,
                gguf_file=a.gguf_file, force=a.force, update=a.update, checks=a.checks, argv=a.argv[1:])
    out = make_report(o)
    print(f"wrote {out / 'report.md'}")


def _model_options(p: argparse.ArgumentParser) -> None:
    """How `generate` and `chat` load their model: QDEC setting, tuning budget, GGUF file, device."""
    p.add_argument("--qdec", type=_qdec_arg, default="on",
                   help="on (default: the tuned setting for this GPU, else k_chunk 8), off, or k_chunk per 1024 "
                        "channels")
    p.add_argument("--budget", type=_budget_arg, default=None,
                   help="slowdown budget whose tuning profile --qdec on uses, in percent (default 5; `localllm tune`)")
    p.add_argument("--gguf-file", help="which GGUF file of a folder to load")
    p.add_argument("--device", default="auto", help="auto (default: the GPU when usable), cpu or cuda")
    p.add_argument("--prefill-int8", action="store_true",
                   help="prompts with 8-bit activations on the int8 tensor cores (off by default; docs/gpu.md)")
    _kv_bits_option(p)


def _kv_bits_option(p: argparse.ArgumentParser, what: str = "") -> None:
    from .kvquant import KV_BITS
    p.add_argument("--kv-bits", type=int, default=16, choices=KV_BITS,
                   help="KV cache width: 16 (default), 8 or 4 (scale and zero per token and head; about 1/2 and "
                        f"1/4 of the fp16 cache's memory){what}")


class _Parser(argparse.ArgumentParser):
    """argparse's errors in one line that names the fix, not after a usage block: for a mistyped option, the option
    meant where one is close; always the command's --help, which lists its options."""

    def error(self, message: str):
        import difflib
        known = [o for o in self._option_string_actions if o.startswith("--")]
        typed = [w for w in message.split() if w.startswith("--")] if message.startswith("unrecognized") else []
        near = [m for w in typed for m in difflib.get_close_matches(w.split("=")[0], known, n=1)]
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        what = "commands" if self._subparsers is not None else "options"
        self.exit(2, f"{self.prog}: error: {message}{hint}; `{self.prog} --help` lists its {what}\n")


def parser() -> argparse.ArgumentParser:
    from .generate import MAX_SEED
    from .sampling import SamplingParams as S  # (its defaults are every command's)
    from .tui.session import ReplySettings
    _seed = _whole_arg("--seed", 0, MAX_SEED)
    from . import __version__
    p = _Parser(prog="localllm", description="Low-bit LLM inference with QDEC error compensation.")
    p.add_argument("--version", action="version", version=f"localllm {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    p.commands = sub.choices  # name -> its parser (main: an unknown option is the command's error)

    g = sub.add_parser("generate", help="generate text (streams to stdout)", usage="localllm generate [MODEL] PROMPT "
                       "[options]", description="localllm generate [MODEL] PROMPT: with no MODEL, the demo model; "
                       "PROMPT - reads it from standard input.")
    g.add_argument("args", nargs="+", metavar="[MODEL] PROMPT")
    g.add_argument("--max-new-tokens", type=int, default=256, help="most tokens of the reply (default 256)")
    g.add_argument("--temperature", type=float, default=S.temperature, help=f"0 = greedy (default {S.temperature})")
    g.add_argument("--top-p", type=float, default=S.top_p,
                   help=f"sample from the most likely tokens up to this probability mass; 1 = off (default {S.top_p})")
    g.add_argument("--top-k", type=int, default=S.top_k, help="0 = off (default)")
    g.add_argument("--min-p", type=float, default=S.min_p,
                   help="drop tokens less likely than this times the most likely one (0 = off; 0.05-0.1 is typical)")
    g.add_argument("--repetition-penalty", type=float, default=S.repetition_penalty, help="1 = off (default)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--seed", type=_seed, help="the same seed gives the same text (default: a new one)")
    g.add_argument("--system", help="system prompt (chat models)")
    g.add_argument("--raw", action="store_true", help="no chat template: continue the prompt text")
    _model_options(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="chat with a model in the terminal",
                       description="localllm chat [MODEL]: a chat UI in the terminal; with no MODEL, the demo model.")
    c.add_argument("model", nargs="?", help="model folder, checkpoint or .gguf file (default: the demo model)")
    c.add_argument("--system", help="system prompt")
    c.add_argument("--temperature", type=float, default=S.temperature, help=f"0 = greedy (default {S.temperature})")
    c.add_argument("--top-p", type=float, default=S.top_p, help=f"as generate's --top-p (default {S.top_p})")
    c.add_argument("--min-p", type=float, default=S.min_p, help="as generate's --min-p (0 = off)")
    c.add_argument("--top-k", type=int, default=S.top_k, help="0 = off (default)")
    c.add_argument("--repetition-penalty", type=float, default=S.repetition_penalty, help="1 = off (default)")
    c.add_argument("--max-new-tokens", type=int, default=ReplySettings.max_new_tokens,
                   help=f"most tokens of a reply (default {ReplySettings.max_new_tokens}: a chat's replies run "
                        "longer than one-off generations)")
    c.add_argument("--seed", type=_seed, help="the same seed for every reply (default: a new one each)")
    _model_options(c)
    c.add_argument("--resume", metavar="FILE",
                   help="go on with a chat that ctrl+s saved (with its system prompt, unless --system)")
    c.add_argument("--save-dir", default=".",
                   help="the existing folder where ctrl+s saves the chat (default: the current folder)")
    c.add_argument("--no-tune", action="store_true",
                   help="on a GPU with no tuning profile for this model, keep QDEC's default k_chunk instead of "
                        "tuning once for --budget (seconds; the profile is saved next to the model)")
    c.set_defaults(func=cmd_chat)

    i = sub.add_parser("info", help="sizes, bits, calibration and tuning profiles of a model")
    i.add_argument("model", nargs="?", help="model folder, checkpoint or .gguf file (default: the demo model)")
    i.add_argument("--json", action="store_true", help="print the facts as JSON")
    i.add_argument("--gguf-file", help="which GGUF file of a folder to describe")
    i.set_defaults(func=cmd_info)

    q = sub.add_parser("quantize", help="quantize a checkpoint (+ QDEC residuals and calibration)")
    q.add_argument("source", help="checkpoint folder (safetensors), .gguf file, or hub id")
    q.add_argument("-o", "--output", required=True, help="new model folder (must not exist)")
    from .quantize import METHODS, MIXED_BITS
    q.add_argument("--bits", default="4", choices=[f"{b:g}" for b in sorted((*BASE_BITS, *MIXED_BITS))],
                   help="bits per weight (default 4); 2.5 / 3.5: half the blocks one bit lower, chosen by KL "
                        "sensitivity")
    q.add_argument("--method", default="rtn", choices=METHODS,
                   help="base quantizer: rtn (round to nearest; the default), awq (activation-aware scaling and "
                        "clipping, then rtn), squeezellm (non-uniform per-channel tables by sensitivity-weighted k-means, over "
                        "weights normalized per group of 128)")
    q.add_argument("--group-size", type=int, default=128, choices=GROUP_SIZES,
                   help="input channels per scale (default 128): rtn and awq; squeezellm takes 128 only")
    q.add_argument("--no-residuals", action="store_true", help="skip QDEC residuals")
    q.add_argument("--head-bits", type=int, default=HEAD_BITS, choices=HEAD_WIDTHS,
                   help="output head: 8-bit (default; half its bytes per token, no measurable loss) or 16 (fp16)")
    q.add_argument("--no-smooth-attention", action="store_true",
                   help="do not fold SmoothAttention factors into the keys (they make a 4-bit KV cache more accurate)")
    q.add_argument("--calib-text", help="UTF-8 text file for calibration (default: built-in sample)")
    q.add_argument("--calib-tokens", type=int, default=4096,
                   help="calibration tokens (default 4096), in whole sequences of 512 (rounded down, at least one): "
                        "activation statistics, AWQ's search, the 3.5-bit mix")
    q.add_argument("--gguf-file", help="which GGUF file of a folder to quantize")
    q.add_argument("--device", default="auto",
                   help="auto (default: the GPU when torch sees one), cpu or cuda: where the blocks are quantized and "
                        "calibrated; the same result up to rounding, many times faster on a GPU")
    q.set_defaults(func=cmd_quantize)

    e = sub.add_parser("eval", help="perplexity of a text (teacher-forced), for QDEC modes and k_chunk values")
    e.add_argument("model", nargs="?", help="model folder or checkpoint (default: the demo model)")
    e.add_argument("--text", help="UTF-8 text file (default: the evaluation text shipped with localllm)")
    e.add_argument("--qdec", help="comma-separated QDEC modes: off, exact, approx, static, random (default "
                                  f"{DEFAULT_EVAL_QDEC}; off alone for a model without residuals)")
    e.add_argument("--k-chunk", default="8",
                   help="comma-separated channels per 1024 for the modes other than off (default 8)")
    e.add_argument("--ctx", type=int, help="tokens per window (default 512, or the model's context where shorter)")
    e.add_argument("--max-tokens", type=int,
                   help="evaluate only the first N tokens of the text (N - 1 predicted; default: all of it)")
    e.add_argument("--seed", type=_seed, default=0,
                   help="seed of random mode's picks (default 0; approx's boundary order is a hash of the input, "
                        "not random)")
    e.add_argument("--reference", nargs="?", const="source", metavar="MODEL",
                   help="also report KL(MODEL || model) per token; with no MODEL, the source checkpoint the model was "
                        "quantized from (its path is recorded in the model folder; give the evaluated model first: "
                        "`eval M --reference`, as `eval --reference M` takes M as the reference)")
    e.add_argument("--gguf-file", help="the .gguf file inside MODEL when MODEL is a folder of GGUF files")
    e.add_argument("--prefill-int8", action="store_true",
                   help="every position with 8-bit activations, as prompts run with --prefill-int8 (CPU)")
    e.add_argument("--device", default="cpu",
                   help="cpu (default; every QDEC mode), or cuda/auto (QDEC modes off and approx; token by token)")
    _kv_bits_option(e)
    e.set_defaults(func=cmd_eval)

    b = sub.add_parser("bench", help="GPU benchmarks: low-bit GEMV kernels vs memory bandwidth and fp16")
    b.add_argument("parts", nargs="*", metavar="PART",
                   help="gemv, gemv-lut, gemv-sweep, e2e, demo, breakdown, qdec, e2e-qdec, tune, prefill, kv, kv-ppl, "
                        "quantize (default: gemv e2e demo; kv-ppl runs on the CPU too, ~25 min on two cores)")
    _kv_bits_option(b, "; for the decoders of e2e, demo, breakdown, e2e-qdec (kv and kv-ppl compare all three)")
    b.set_defaults(func=cmd_bench)

    t = sub.add_parser("tune", help="measure this GPU and pick QDEC's k_chunk and n_tb per layer type for "
                                    "slowdown budgets; writes MODEL/profiles/*.json",
                       description="localllm tune [MODEL]: with no MODEL, the demo model.")
    t.add_argument("model", nargs="?", help="quantized model folder with residuals (default: the demo model)")
    t.add_argument("--budget", default="2.5,5,10,20",
                   help="decode slowdown budgets in percent, comma-separated (default 2.5,5,10,20; 5%% works too)")
    t.add_argument("--no-eval", action="store_true", help="skip the perplexity column")
    t.add_argument("--tokens", type=int, default=512,
                   help="tokens of the shipped evaluation text for the perplexity column (default 512)")
    t.add_argument("--force", action="store_true",
                   help="replace a file at a profile's name even when it is not this GPU/model/budget's profile")
    t.add_argument("--reps", type=_whole_arg("--reps", 1), default=20,
                   help="CUDA graph replays per GEMV timing point (default 20)")
    t.set_defaults(func=cmd_tune)

    r = sub.add_parser("report", help="the QDEC paper's experiments on a model: a Markdown report with plots",
                       description="localllm report [MODEL]: quantizes MODEL (a checkpoint; default: the demo model) "
                                   "at each --bits, measures perplexity and activation statistics on the CPU, and "
                                   "the QDEC kernel and the tuner's budgets on the GPU when one is usable; writes "
                                   "report.md, report.json and PNG plots into a new folder (needs matplotlib: pip "
                                   "install 'localllm[report]'). Measurements are saved in the folder's "
                                   "report.unfinished.json as they are made (report.json is written at the end): "
                                   "rerunning an interrupted command resumes it.")
    r.add_argument("model", nargs="?", help="checkpoint folder, .gguf file or hub id (default: the demo model)")
    r.add_argument("-o", "--output", "--out", dest="out",
                   help="folder for the report (default: report-<model name>): a new or empty one; one holding "
                        "this command's unfinished report resumes it; --force / --update act on one holding a "
                        "localllm report (its report files only)")
    r.add_argument("--tokens", type=int, default=2048, help="predicted tokens of the evaluation text (default 2048)")
    r.add_argument("--ctx", type=int, help="tokens per evaluation window (default 512, or the model's context where "
                                           "shorter)")
    r.add_argument("--bits", default="2,3,4", help="base widths to compare (default 2,3,4)")
    r.add_argument("--k-chunk", default="8,16,32,64,128", help="k_chunk values (default 8,16,32,64,128)")
    r.add_argument("--compare-bits", type=int, default=3,
                   help="base width of the selection-mode, residual-width and outlier sections (default 3)")
    r.add_argument("--residual-bits", default="2,8,16",
                   help="residual widths compared with 4 bits at equal PCIe bytes (default 2,8,16; 16 = fp16; "
                        "empty to skip; 8 is slow to quantize on billion-weight models)")
    r.add_argument("--group-size", type=int, default=128, choices=GROUP_SIZES,
                   help="input channels per scale of the quantized variants (default 128)")
    r.add_argument("--budget", default="2.5,5,10,20,50,100",
                   help="tuner budgets in percent for the GPU Pareto section (default 2.5,5,10,20,50,100: the large "
                        "ones show what compensation costs where QDEC's fixed cost per call exceeds the small ones)")
    r.add_argument("--checks", default="auto", choices=("auto", "on", "off"),
                   help="the check that every channel compensated with the FP16 residual gives the source model: an "
                        "evaluation that gathers the whole residual per token (~17 min for 1.5B weights on one CPU "
                        "thread); auto (default) runs it for models under 0.5e9 linear weights")
    r.add_argument("--sections", help="comma-separated: quality, outliers, kernel, pareto (default: all; the GPU "
                                      "ones, kernel and pareto, only where a GPU is usable)")
    r.add_argument("--text", help="UTF-8 evaluation text (default: the one shipped with localllm)")
    r.add_argument("--seed", type=_seed, default=0, help="seed of the random picks (default 0)")
    r.add_argument("--gguf-file", help="which GGUF file of a folder to use")
    r.add_argument("--force", action="store_true",
                   help="start -o's report over (a folder holding a localllm report; the report's own files are "
                        "replaced, anything else in it stays)")
    r.add_argument("--update", action="store_true",
                   help="measure again in -o's report (a folder holding one), keeping the sections that this run "
                        "does not measure")
    r.set_defaults(func=cmd_report)
    return p


class _Signalled(KeyboardInterrupt):
    """SIGTERM or SIGHUP, unwound as Ctrl+C is; the exit status says which (128 + its number, as the shell's)."""
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum, frame):
    raise _Signalled(signum)


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a, rest = p.parse_known_args(argv)
    if rest and a.command == "generate" and all(r == "-" or not r.startswith("-") for r in rest):
        a.args += rest  # an option between MODEL and PROMPT splits the positionals; they are still MODEL PROMPT
    elif rest:  # with the command's usage (its options), not the top level's
        p.commands[a.command].error(f"unrecognized arguments: {' '.join(rest)}")
    a.argv = sys.argv[1:] if argv is None else list(argv)  # how it was called (the report records it)
    for stream in (sys.stdout, sys.stderr):  # a terminal that is not UTF-8 shows what it cannot as ?, not a crash
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
    # `timeout`, kill, a closed terminal: unwind as Ctrl+C does, so that no unfinished temp folder is left behind
    # (not in the chat, whose terminal Textual restores; not off the main thread, where Python allows no handler)
    # (a signal ignored, as nohup ignores SIGHUP, stays ignored: the run outlives the terminal, as asked)
    unwind = a.command != "chat" and threading.current_thread() is threading.main_thread()
    before = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)
              if signal.getsignal(sig) is not signal.SIG_IGN} if unwind else {}
    try:
        return _run(a)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


# what a command's result is, for those whose result only goes to standard output
_PRINTED = {"generate": "the reply", "info": "the model's description", "eval": "the perplexity table",
            "bench": "the benchmark tables"}


def _run(a) -> int:
    try:
        if sys.stdout is None and a.command in _PRINTED:  # (print() would drop it without a word)
            raise LocalLLMError(f"standard output is closed: {_PRINTED[a.command]} is written there (redirect it to "
                                "a file)")
        a.func(a)
    except LocalLLMError as e:
        print(f"localllm: error: {e}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError as e:  # past the checks at load: a long prompt, a long reply, a benchmark
        first = (str(e).strip().splitlines() or ["CUDA out of memory"])[0][:200]
        print(f"localllm: error: out of GPU memory ({first}); a shorter prompt, fewer new tokens, --kv-bits 8 or 4, "
              "or a smaller model needs less", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print("\nlocalllm: interrupted", file=sys.stderr)
        return 128 + getattr(e, "signum", signal.SIGINT)
    except BrokenPipeError:  # the reader of a pipe left (`localllm info M | head -1`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that the exit's flush does not fail too
        return 0
    except OSError as e:  # past the checks of the input: the disk (full, over a size limit or quota, failing)
        what = f"{e.strerror}: {e.filename}" if e.strerror and e.filename else str(e)
        print(f"localllm: error: {what}; check the disk (free space, size limits, permissions) and run the command "
              "again (files are written whole or not at all)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
