"""A loaded model ready to run: the decoder, its tokenizer, its manifest and QDEC settings."""
from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import devices, kvquant, modelfile, ops
from .devices import WORKSPACE_BYTES, check_float32_fits, check_kv_cache, gpu_free, resolve_device, size
from .errors import LocalLLMError, is_real, is_whole
from .loader import Checkpoint, check_path_text, is_model_folder, open_checkpoint, tokenizer_of
from .model import KINDS, QDEC_MODES, QdecSettings, RMSNorm, Transformer, build_block, in_blocks
from .tuner import profile as tuning
from .tuner.profile import DEFAULT_BUDGET

DEFAULT_K_CHUNK = 8  # channels per 1024 compensated when QDEC is on and no tuning profile applies


def _describe_k(ks: dict, blocks: dict | None = None) -> str:
    vals = set(ks.values())
    out = f"k_chunk {vals.pop()}" if len(vals) == 1 else "k_chunk " + ", ".join(f"{k} {v}" for k, v in ks.items())
    return out + "".join(f" ({k} in blocks {', '.join(map(str, sorted(b)))} only)" if b else f" ({k} in no block)"
                         for k, b in (blocks or {}).items())


@dataclass
class LocalModel:
    """A loaded model (what localllm.load() returns) for localllm.generate(). Public: encode(prompt) and
    context_length; set_qdec(qdec, budget) and set_kv_bits(bits) (QDEC and the KV cache width, for later replies);
    autotune() (a tuning profile for this GPU); warm_up(n); cached_tokens(); sizes(); qdec_summary(); the attributes
    path, manifest (None: a dense checkpoint), kv_bits, budget, qdec_source, qdec_overhead, has_residuals; model
    (the Transformer) and tokenizer. runtime.describe(lm) gives what `localllm info` prints."""
    model: Transformer
    tokenizer: object
    manifest: dict | None  # None: a dense source checkpoint, not quantized
    path: str
    eos_ids: list[int]
    _decoder: object = field(default=None, repr=False)  # decode.Decoder kept between replies (its CUDA graph)
    budget: float = DEFAULT_BUDGET  # the slowdown budget whose tuning profile qdec="on" uses on a GPU
    qdec_source: str = "QDEC off"  # one line: where the QDEC setting comes from (shown by the chat UI)
    qdec_overhead: float | None = None  # the tuning profile's measured decode slowdown (0.041 = +4.1%), else None
    qdec_untuned: bool = False  # qdec="on" on a GPU fell back to the default k_chunk: no tuning profile applies
    _tuned: object = field(default=None, repr=False)  # tuner.profile.Selection for self.budget, looked up once
    kv_bits: int = 16  # KV cache width: 16 (the model's dtype), 8 or 4 (kvquant); set_kv_bits changes it
    _smooth_noted: bool = field(default=False, repr=False)  # set_kv_bits said the model has no SmoothAttention
    source_files: list | None = field(default=None, repr=False)  # a dense model's weight files (loader.fingerprint)
    _asked: tuple | None = field(default=None, repr=False)  # set_qdec's last request and what it decided
    # generate() runs one reply at a time: the KV cache and the sampling generator are shared. A reply holds the lock
    # while it reads its prompt and at each step; `reply` names the latest, and an earlier stream still open stops
    # with an error at its next token instead of writing into the cache the later one uses.
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    reply: object = field(default=None, repr=False)

    @property
    def settings(self) -> QdecSettings:
        return self.model.settings

    @property
    def has_residuals(self) -> bool:
        return any(lin.residual is not None for lin in self.model.linears())

    @property
    def smooth_attention(self) -> bool:
        """Whether `localllm quantize` folded SmoothAttention factors into this model's keys (older files: no)."""
        return bool((self.manifest or {}).get("smooth_attention"))

    def set_kv_bits(self, bits: int) -> None:
        """KV cache width for the next decoder: 16, 8 or 4 (per token and head, kvquant). A 4- or 8-bit cache of a
        model without SmoothAttention factors works, with larger key errors: a note says so. Waits for a reply's
        step (as set_qdec); an open stream stops at its next piece."""
        bits = kvquant.check_bits(bits)
        with self.lock:
            if bits == self.kv_bits:
                return
            self.kv_bits, self._decoder, self.reply = bits, None, None
        if bits < 16 and not self.smooth_attention and not self._smooth_noted:
            self._smooth_noted = True  # once a model
            if self.manifest is None:
                what, fix = "is not quantized by localllm", ": `localllm quantize` it to get them"
            elif "smooth_attention" in self.manifest:  # None: made with --no-smooth-attention, on purpose
                what, fix = "was quantized with --no-smooth-attention", ""
            else:
                what, fix = "was quantized before localllm made them", ": `localllm quantize` the source again to get them"
            print(f"localllm: note: {self.path} has no SmoothAttention factors (it {what}); its quantized keys are "
                  f"unsmoothed, with larger errors{fix}", file=sys.stderr)

    def decoder(self, max_len: int, keep: bool = False):
        """A Decoder whose cache holds max_len tokens: the one kept from an earlier reply when it is long enough (so
        its captured CUDA graph is replayed, not captured again), else a new one, rounded up to 256 tokens and, where
        memory allows, at least twice the old one's length: a chat's history grows every turn, and each new Decoder
        costs a graph capture (~40 ms for the demo model on the H100). keep: a new Decoder takes over what the old
        one's cache holds (a chat reusing it). On the CPU, where no graph is kept, a cache over twice the need is
        made anew at the need unless keep. On a GPU a cache that does not fit is refused in one line naming the
        kv-bits setting that would fit; on the CPU one that does not fit the host's available memory."""
        from .decode import Decoder
        limit = self.model.cfg.max_position_embeddings
        need = min(limit, -(-max_len // 256) * 256)
        # on the CPU (no captured graphs to keep), a cache over twice what a reply that starts afresh needs is let go:
        # one long request (a large max_new_tokens, ended early) held its memory for every later reply
        shrink = not keep and self._decoder is not None and self.model.device.type != "cuda" and \
            self._decoder.max_len > 2 * need
        if self._decoder is None or shrink or self._decoder.max_len < min(max_len, limit):  # (never over the context)
            n = need if shrink else min(limit, max(need, 2 * self._decoder.max_len if self._decoder is not None else 0))
            kept = self._decoder.kept() if keep and self._decoder is not None else None
            self._decoder = None  # free the old cache first
            dev = self.model.device
            if dev.type != "cuda":  # the first forward makes the CPU's form of the weights: before free is read
                self.model.make_ready()
            free = gpu_free(dev) if dev.type == "cuda" else devices.host_available()
            if free is not None:
                cpu = dev.type != "cuda"
                try:
                    check_kv_cache(self.model.cfg, n, self.kv_bits, free - WORKSPACE_BYTES, cpu)
                except LocalLLMError:
                    if n == need:
                        raise
                    n = need  # the doubling does not fit: just what is needed
                    check_kv_cache(self.model.cfg, n, self.kv_bits, free - WORKSPACE_BYTES, cpu)
            self._decoder = Decoder(self.model, n, kv_bits=self.kv_bits)
            if kept is not None:  # a chat that outgrows its cache keeps what it holds
                self._decoder.restore(*kept)
        return self._decoder

    @property
    def context_length(self) -> int:
        """The most tokens a prompt and its reply can take together (ModelConfig.context says why where a
        sliding-window attention's window set it)."""
        return self.model.cfg.max_position_embeddings

    def encode(self, prompt: str | list[dict]) -> list[int]:
        """The token ids generate() reads for `prompt` (a string as it is, chat messages through the model's chat
        template), e.g. to count them against context_length before a call; refused in one line as generate()
        refuses it."""
        from .generate import _check_prompt, encode_prompt
        _check_prompt(prompt)
        return encode_prompt(self, prompt)

    def cached_tokens(self) -> list[int]:
        """The tokens whose keys and values the KV cache holds from position 0 (Decoder.cached; none before a reply)."""
        return self._decoder.cached() if self._decoder is not None else []

    def warm_up(self, max_len: int) -> None:
        """On a GPU, do now what a first reply of up to max_len tokens (prompt and reply) would otherwise wait for:
        the Decoder and its KV cache, the prompt kernels, and the captured decode graphs of a greedy and a sampled
        choice (without this the demo model's first reply ran at 0.55-0.8x of later ones on the H100). A chat UI calls
        it while it loads; set_qdec and a longer reply make a new Decoder, whose graphs are captured at first use
        again. On the CPU: the weights in the form they run in (Transformer.make_ready)."""
        if not (is_whole(max_len) and max_len >= 1):
            raise LocalLLMError(f"warm_up takes the tokens a first reply may hold (prompt and reply), a whole number "
                                f"of at least 1, got {max_len!r}")
        if self.model.device.type != "cuda":
            self.model.make_ready()
            return
        from .progress import progress
        try:
            dec = self.decoder(max_len)
        except LocalLLMError:  # that much cache does not fit: the first reply sizes its own, and says if it cannot
            return
        steps = (lambda: dec.prefill([0] * 8),  # the cache's first rows, overwritten by the first prompt
                 lambda: dec.capture(greedy=True), lambda: dec.capture(greedy=False))
        with torch.inference_mode():  # as generate() runs
            for step in progress(steps, "capturing decode graphs", unit="step"):
                step()
        torch.cuda.synchronize(self.model.device)

    def set_qdec(self, qdec: str | int | dict = "on", budget: float | None = None) -> None:
        """qdec: "on", "off", a k_chunk for every layer type, or a dict {"mode": "exact"|"approx"|"static"|"random",
        "k_chunk": int | {kind: int}, "n_tb": int | {kind: int} (GPU only; default: qdec.default_n_tb), "blocks":
        {kind: [block indices]} (optional: a kind's layers compensated in these blocks only)}.

        "on" on a GPU: the tuning profile of this GPU and model for the slowdown budget (`budget`, a fraction, kept
        in self.budget; see tuner.profile.select), else DEFAULT_K_CHUNK with a one-line warning when the profiles
        here were made on another GPU or model. On the CPU, "on" is DEFAULT_K_CHUNK. Sets qdec_source (one line
        saying where the setting comes from) and qdec_overhead (the profile's measured slowdown, else None).
        A refused value changes nothing; the setting already in force, asked for again, keeps the KV cache (and a
        GPU's captured graphs). Waits for a reply's step (the lock): a reply does not go on under a new setting; an
        open stream stops at its next piece (the cache it read is gone)."""
        with self.lock:
            self._set_qdec_locked(qdec, budget)

    def _set_qdec_locked(self, qdec, budget) -> None:
        _check_budget(budget)
        off = qdec_off(qdec)
        if not (off or qdec_on(qdec) or is_whole(qdec) or isinstance(qdec, dict)):
            raise LocalLLMError(f"qdec={qdec!r} is not understood; use 'on', 'off', a k_chunk integer or a dict")
        unknown = sorted(map(str, set(qdec) - {"mode", "k_chunk", "n_tb", "blocks"})) if isinstance(qdec, dict) else []
        if unknown:
            raise LocalLLMError(f"qdec has unknown keys {', '.join(unknown)}; a dict takes mode, k_chunk, n_tb and "
                                "blocks")
        if not off and not self.has_residuals:
            raise LocalLLMError(f"{self.path} has no QDEC residuals; re-quantize it with residuals, or turn QDEC "
                                "off (--qdec off; in Python qdec='off')")
        # (by repr: True == 1, but "on" is not k_chunk 1)
        if self._asked is not None and self._asked == (repr(qdec), budget, self._qdec_state()):
            return
        before = self.budget, self._tuned
        if budget is not None and budget != self.budget:
            self.budget, self._tuned = budget, None
        try:
            self._set_qdec(qdec, off)
        except LocalLLMError:
            self.budget, self._tuned = before
            raise
        self._decoder, self.reply = None, None  # a captured graph holds the old settings
        self._asked = (repr(qdec), budget, self._qdec_state())

    def _qdec_state(self) -> tuple:
        """What set_qdec decided, to tell a request already in force (a direct change of settings or new profiles
        make it another)."""
        s = self.settings
        return s.mode, dict(s.k_chunk), {k: frozenset(v) for k, v in s.blocks.items()}, self._tuned, self.budget

    def _set_qdec(self, qdec, off: bool) -> None:
        self.qdec_untuned = False
        if off:
            self.settings.mode, self.qdec_source, self.qdec_overhead = "off", "QDEC off", None
            return
        if qdec_on(qdec):
            self._set_on()
            return
        if is_whole(qdec):
            placed = self._apply("approx", qdec)
        else:
            placed = self._apply(qdec.get("mode", "approx"), qdec.get("k_chunk", DEFAULT_K_CHUNK), qdec.get("n_tb"),
                                 qdec.get("blocks"))
        if placed and self.settings.mode != "off":
            self.qdec_source = f"{_describe_k(self.settings.k_chunk, self.settings.blocks)} (set by hand)"
        self.qdec_overhead = None

    def _set_on(self) -> None:
        """qdec="on": the tuned profile on a GPU when one applies, else the default k_chunk."""
        self.qdec_overhead = None
        if self.model.device.type != "cuda":
            self._apply("approx", DEFAULT_K_CHUNK)
            self.qdec_source = f"default k_chunk {DEFAULT_K_CHUNK} (CPU; tuning profiles are for the GPU)"
            return
        if self._tuned is None:  # look once per budget: warnings are shown once, not at every toggle
            props = torch.cuda.get_device_properties(self.model.device)
            sel = tuning.select(self.path, props.name, props.multi_processor_count,
                                (self.manifest or {}).get("model_id"), self.budget)
            for w in sel.warnings:
                print(f"localllm: warning: {w}", file=sys.stderr)
            self._tuned = sel
        sel = self._tuned
        while sel.candidates:  # the preferred profile first; one that does not fit this model gives way to the next
            path, profile = sel.candidates[0]
            layers = profile["layers"]
            try:
                placed = self._apply("approx", {k: v["k_chunk"] for k, v in layers.items()},
                                     {k: v["n_tb"] for k, v in layers.items()},
                                     {k: v["blocks"] for k, v in layers.items() if "blocks" in v})
            except LocalLLMError as e:
                then = f"the next, {sel.candidates[1][0].name}" if len(sel.candidates) > 1 else \
                    f"the default k_chunk {DEFAULT_K_CHUNK}"
                w = f"tuning profile {path} does not fit this model ({e}); using {then}: re-run `localllm tune " \
                    f"{self.path}`"
                print(f"localllm: warning: {w}", file=sys.stderr)
                sel.warnings.append(w)
                sel.misfits.append(sel.candidates.pop(0)[0])
                continue
            sel.path, sel.profile = path, profile
            if placed:
                self.qdec_source, self.qdec_overhead = tuning.source_of(profile), profile.get("slowdown")
            return
        sel.path = sel.profile = None
        if self._apply("approx", DEFAULT_K_CHUNK):
            self.qdec_source = f"default k_chunk {DEFAULT_K_CHUNK}: " + (
                "this GPU's tuning profiles do not fit this model" if sel.misfits else
                "no tuning profile for this GPU") + f" (run `localllm tune {self.path}`)"
            self.qdec_untuned = True

    def profiles_changed(self) -> None:
        """Tuning profiles were written next to the model: the next set_qdec("on") looks them up again."""
        self._tuned = None

    @property
    def tuning_warned(self) -> bool:
        """Whether looking up this GPU's tuning profile printed a warning (profiles there, made for another GPU or
        model)."""
        return self._tuned is not None and bool(self._tuned.warnings)

    def autotune(self) -> None:
        """Tune QDEC on this GPU for self.budget (GEMV timings and measured decode steps, no perplexity), write the
        profile next to the model and use it. load(..., tune=True) does this where QDEC would run untuned (`localllm
        chat` asks for it): the default k_chunk on every layer can cost far more than a budget (the
        demo model on an H100: +117% per token, its GEMVs lasting ~2 us against a ~5 us compensating chain)."""
        from .tuner.tune import tune
        try:
            tune(self, [self.budget], evaluate=False)
        finally:  # the new profile, or (tuning failed) the default as before
            self.set_qdec("on")

    def _apply(self, mode: str, k: int | dict, n_tb: int | dict | None = None, blocks: dict | None = None) -> bool:
        """Check and apply a QDEC setting (on a GPU: place every compensated layer's launch). False: the launches
        could not be placed (host memory), QDEC is off and qdec_source says why."""
        s = self.settings
        if mode not in QDEC_MODES[1:]:
            raise LocalLLMError(f"QDEC mode '{mode}' is unknown; use one of {', '.join(QDEC_MODES[1:])}")
        for name, v in (("k_chunk", k), ("n_tb", n_tb)):  # a kind misspelt would quietly turn it off
            ok = v is None and name == "n_tb" or is_whole(v) or isinstance(v, dict) and set(v) <= set(KINDS) and all(
                is_whole(x) or x is None and name == "n_tb" for x in v.values())  # (None: the default n_tb)
            if not ok:
                raise LocalLLMError(f"QDEC {name} {v!r} is not understood: give a whole number or a dict of the "
                                    f"layer kinds {', '.join(KINDS)} to whole numbers")
        ks = {kind: k for kind in KINDS} if is_whole(k) else {kind: int(k.get(kind, 0)) for kind in KINDS}
        n = len(self.model.blocks)
        if not isinstance(blocks, (dict, type(None))):
            raise LocalLLMError(f"QDEC blocks {blocks!r} is not understood: give a dict of the layer kinds "
                                f"{', '.join(KINDS)} to lists of block indices within 0..{n - 1}")
        bad = [kind for kind, b in (blocks or {}).items() if kind not in KINDS or not isinstance(b, (list, tuple, set,
               frozenset)) or not all(is_whole(i) and 0 <= i < n for i in b)]
        if bad:
            raise LocalLLMError(f"QDEC blocks for {', '.join(map(str, bad))}: give layer kinds ({', '.join(KINDS)}) "
                                f"and block indices within 0..{n - 1}")
        blocks = {kind: frozenset(b) for kind, b in (blocks or {}).items()}
        # approximate top-k needs a calibrated bucket boundary for k; the other modes go up to a whole chunk
        kmax = self.manifest["calibration"]["kmax"] if mode == "approx" else 1024
        if bad := sorted({v for v in ks.values() if not 0 <= v <= kmax}):
            why = " (the largest this model's calibration covers; exact, static and random go up to 1024)" \
                if mode == "approx" else ""
            raise LocalLLMError(f"k_chunk {', '.join(map(str, bad))} is outside 0..{kmax} for QDEC mode '{mode}'{why}")
        nts = {kind: n_tb for kind in KINDS} if n_tb is None or is_whole(n_tb) else \
            {kind: n_tb.get(kind) for kind in KINDS}
        if not any(ks.values()):  # nothing to compensate
            s.mode, s.k_chunk, s.blocks, self.qdec_source = "off", ks, {}, "QDEC off (k_chunk 0 everywhere)"
            return True
        if self.model.device.type == "cuda":
            if mode != "approx":
                raise LocalLLMError(f"on the GPU QDEC selects by approximate top-k only, not '{mode}'; use "
                                    "mode 'approx', or device='cpu' for the other selection modes")
            self._check_qdec_shared_memory(ks)  # a k_chunk this GPU cannot run is the caller's error, not a fallback
            self._check_n_tb(ks, nts)
            try:
                self._place_qdec(ks, nts, blocks)
            except LocalLLMError as e:  # compensation is an improvement, not a requirement: run without it
                print(f"localllm: {e}; running without QDEC", file=sys.stderr)
                s.mode, self.qdec_source = "off", f"QDEC off ({e})"
                return False
        s.mode, s.k_chunk, s.blocks = mode, ks, blocks
        return True

    def _compensated(self, ks: dict, blocks: dict | None = None) -> list:
        return [lin for lin in self.model.linears() if lin.residual is not None and ks[lin.kind] > 0
                and in_blocks(blocks or {}, lin.kind, lin.block)]

    def _check_qdec_shared_memory(self, ks: dict) -> None:
        """Refuse a k_chunk whose QDEC GEMV needs more shared memory per block than this GPU has."""
        from .kernels import cuda, qdec
        from .kernels.gemv import grid_of
        dev = self.model.device
        smem_max = cuda.shared_limit(dev.index or 0)
        for lin in self._compensated(ks):
            k = ks[lin.kind]
            if qdec.shared_bytes_total(lin.packed, k, grid_of(lin.out_features, dev), smem_max) > smem_max:
                raise LocalLLMError(f"k_chunk={k} for the {lin.kind} layers needs more shared memory than this GPU "
                                    f"has per block ({smem_max} bytes); use a smaller k_chunk")

    def _check_n_tb(self, ks: dict, nts: dict) -> None:
        """Refuse an n_tb the QDEC GEMV cannot split its work into (kernels.qdec.viable_n_tb)."""
        from .kernels import qdec
        from .kernels.gemv import grid_of
        for lin in self._compensated(ks):
            n = nts.get(lin.kind)
            ok = qdec.viable_n_tb(lin.in_features, lin.out_features, grid_of(lin.out_features, self.model.device))
            if n is not None and n not in ok:
                raise LocalLLMError(f"n_tb={n} is not viable for the {lin.kind} layers on this GPU; use one of "
                                    f"{ok}")

    def _place_qdec(self, ks: dict, nts: dict | None = None, blocks: dict | None = None) -> None:
        """Give every compensated GPU layer its QDEC launch: residuals pinned in host memory (once), its flags, the
        model's shared buffer of partial corrections, and k_chunk / n_tb (nts: per kind, None for the default)."""
        from .kernels import qdec
        from .kernels.gemv import grid_of
        dev = self.model.device
        lins = self._compensated(ks, blocks)
        todo = [lin for lin in lins if lin.host_residual is None]
        if todo:
            need, free = sum(lin.residual.nbytes for lin in todo), devices.host_available()
            if free is not None and need > free:  # pinning past it would swap, or end in the OOM killer
                raise LocalLLMError(f"QDEC's residuals need {size(need)} of pinned host memory but {size(free)} is "
                                    "available; free host RAM, or run with QDEC off (--qdec off)")
            from .progress import progress
            for lin in progress(todo, "pinning residuals", unit="layer"):
                qdec.pin(lin)
        part = qdec.new_part([(lin.in_features, lin.out_features) for lin in lins], dev)
        for lin in self.model.linears():
            lin.comp = None
        for lin in lins:
            K, N, k = lin.in_features, lin.out_features, ks[lin.kind]
            grid = grid_of(N, dev)
            n_tb = (nts or {}).get(lin.kind) or qdec.default_n_tb(K, N, grid, k)
            lin.comp = qdec.Call(lin.host_residual, qdec.new_state(K, N, dev), part, k, n_tb, lin.stats.b0,
                                 lin.stats.b15(k), grid)

    def qdec_summary(self) -> str:
        """What QDEC does and why, one line: "QDEC approx: k_chunk 16 (set by hand)", "QDEC off: tuned on ... for a
        5% budget: no compensation fits it"."""
        src = self.qdec_source
        if self.settings.mode != "off":
            return f"QDEC {self.settings.mode}: {src}"
        return src if src.startswith("QDEC off") else f"QDEC off: {src}"

    def sizes(self) -> dict:
        """Bytes the model needs on a GPU (packed weights, the head, norms) and pinned on the host: the QDEC residuals
        (when QDEC is on) and the fp16 embeddings, unless the head shares them (Transformer.place); and on the CPU,
        which runs every weight as float32, or where that does not fit its quantized weights unpacked
        (fit_cpu_memory)."""
        m = self.model
        embed = 2 * m.embed.numel()
        # on the CPU: where Transformer.place would put them on a GPU
        host_embed = not m.tied and ops.host_rows(m.embed) if m.device.type in ("cpu", "meta") else \
            m.embed.device.type == "cpu"
        gpu = 2 * sum(n.weight.numel() for n in self._norms()) + (0 if host_embed else embed)
        cpu = m.embed.numel() * (4 if m.tied else m.embed.element_size())  # float32 where the head shares it
        host, cpu_unpacked = 0, cpu
        for lin in [*m.linears(), *([] if m.tied else [m.head])]:
            gpu += lin.nbytes if lin.weight is None else lin.nbytes // lin.weight.element_size() * 2  # fp16
            cpu, cpu_unpacked = cpu + lin.cpu_bytes(), cpu_unpacked + lin.cpu_bytes(unpacked=True)
            if lin.residual is not None:
                host += lin.residual.nbytes  # pinned when QDEC is on
        # (the CPU holds the residuals too, in the same 4-bit form, which its QDEC reads)
        return {"gpu_bytes": gpu, "pinned_host_bytes": host, "pinned_embed_bytes": embed if host_embed else 0,
                "cpu_bytes": cpu + host, "cpu_unpacked_bytes": cpu_unpacked + host}

    def _norms(self):
        yield self.model.norm
        for b in self.model.blocks:
            yield from (b.attn_norm, b.mlp_norm)


def load(src: str | Path | None = None, gguf_file: str | None = None, qdec: str | int | dict = "on",
         verify: bool = True, device: str | torch.device = "cpu", budget: float | None = None,
         kv_bits: int = 16, prefill_int8: bool = False, tune: bool | None = None) -> LocalModel:
    """Load a quantized model folder, a source checkpoint (dense, no QDEC), or, with no src, the demo model.

    device: "cpu", "cuda" or "auto". qdec applies when the model has residuals (see LocalModel.set_qdec); on a GPU
    the residuals are pinned in host memory once the weights are placed, and qdec="on" takes the tuning profile of
    this GPU for `budget` (a fraction of the decode time; default DEFAULT_BUDGET, 5%) when `localllm tune` made
    one. Without one it runs the default k_chunk on every layer, which can cost far more than a budget: tune=True
    tunes once instead (LocalModel.autotune: seconds; the profile is saved next to the model; `localllm chat` does
    this), tune=None (the default) says so in one line, tune=False runs it silently. kv_bits: the KV cache width, 16
    (default), 8 or 4 (LocalModel.set_kv_bits). prefill_int8: prompts with 8-bit activations (QdecSettings.act8)."""
    kvquant.check_bits(kv_bits)
    _check_budget(budget)  # before loading
    for name, v, kinds in (("prefill_int8", prefill_int8, (bool,)), ("verify", verify, (bool,)),
                           ("tune", tune, (bool, type(None)))):
        if not isinstance(v, kinds):  # ("no" would be true)
            raise LocalLLMError(f"{name}={v!r}: give True or False" + (" (or None)" if name == "tune" else ""))
    if not (src is None or isinstance(src, (str, os.PathLike))) or src == "":
        raise LocalLLMError(f"load() takes a model folder, a .gguf file or a hub id (or None: the demo model), got "
                            f"{src!r}")
    dev = resolve_device(device)
    demo = src is None
    if demo:
        from .demo import demo_model
        src = demo_model()
    check_path_text(src)
    path = Path(src).expanduser()
    if is_model_folder(path):
        if gguf_file:  # a quantized folder has no GGUF to pick: the name would be ignored, and the user misled
            raise LocalLLMError(f"{path} is a quantized model folder, which holds no GGUF: drop --gguf-file "
                                f"{gguf_file} (it picks a file of a source checkpoint folder)")
        try:
            model, manifest = modelfile.load(path, verify=verify)
        except LocalLLMError as e:
            if not demo:
                raise
            what = str(e).split("; ")[0]  # its own fix (re-run quantize) is not the demo's
            raise LocalLLMError(f"the cached demo model is damaged ({what}); delete {path} and run again: it is made "
                                "anew from the demo GGUF") from None
        lm = LocalModel(model, tokenizer_of(path, model.cfg.vocab_size), manifest, str(path),
                        manifest.get("eos_token_ids", []))
    else:
        lm = _dense(open_checkpoint(src, gguf_file), src)
    lm.settings.act8 = prefill_int8
    lm.set_kv_bits(kv_bits)
    if dev.type != "cpu":
        check_gpu_memory(lm, dev)
        check_shared_memory(lm, dev)
        lm.model.place(dev)
    else:
        fit_cpu_memory(lm)
    if not lm.has_residuals and not qdec_on(qdec):  # (the default "on" is off there without a word)
        lm.set_qdec(qdec)  # off; anything else refused in one line: not understood, or no residuals to compensate with
    if lm.manifest:
        lm.set_qdec(qdec if lm.has_residuals else "off", budget)
        if not lm.has_residuals:
            lm.qdec_source = "QDEC off: the model has no residuals"
        if lm.qdec_untuned and tune is not False:
            _tune_or_say(lm, tune)
    return lm


def _tune_or_say(lm: LocalModel, tune: bool) -> None:
    """QDEC fell back to the default k_chunk on a GPU (no tuning profile): tune once, or say what it costs (unless a
    warning about the profiles there has said so)."""
    if tune:
        try:
            lm.autotune()
        except (LocalLLMError, OSError) as e:  # e.g. a profile file in the way, a read-only folder: the default
            print(f"localllm: could not tune QDEC ({e}); using {lm.qdec_source}", file=sys.stderr)
    elif not lm.tuning_warned:
        print(f"localllm: no QDEC tuning profile for this GPU and model, so every layer compensates at k_chunk "
              f"{DEFAULT_K_CHUNK}, which can slow decoding by half or more; `localllm tune {lm.path}` makes one "
              "(seconds, once)", file=sys.stderr)


def qdec_off(qdec) -> bool:
    """Whether a qdec value (LocalModel.set_qdec's) means QDEC off."""
    return qdec in ("off", 0, None, False)


def qdec_on(qdec) -> bool:
    """Whether a qdec value means "on" (not `in ("on", True)`: 1 == True would make k_chunk 1 "on")."""
    return qdec is True or qdec == "on"


def _check_budget(budget) -> None:
    # (not a bool; at least 1e-6, as --budget rounds: a smaller one would name a "0pct" profile)
    ok = is_real(budget) and 1e-6 <= budget <= 1
    if budget is not None and not ok:
        raise LocalLLMError(f"budget={budget!r}: the tuning budget is a fraction of the decode time in (0, 1], e.g. "
                            "0.05 for 5%")


CPU_HEADROOM = 1 << 30  # host memory left for activations, the KV cache and the rest when weights are sized


def fit_cpu_memory(lm: LocalModel) -> None:
    """On the CPU each quantized layer is dequantized to float32 when first run and kept beside its packed form (an 8B
    model then needs ~35 GB). Where that would not fit the host's available memory, every quantized layer runs
    unpacked instead (model.Linear.unpack: ~1 byte a weight, the same results, a decode step ~2x slower); says so in
    one line, and where even that does not fit, that too."""
    free = devices.host_available()
    lins = [lin for lin in (*lm.model.linears(), lm.model.head) if lin.quant is not None]
    if free is None or not lins:
        return
    # what each form adds beyond the packed weights already loaded
    as_float32, unpacked = (sum(lin.cpu_bytes(u) - lin.nbytes for lin in lins) for u in (False, True))
    room = free - CPU_HEADROOM
    if as_float32 <= room:
        return
    for lin in lins:
        lin.unpack()
    print(f"localllm: on the CPU {lm.path}'s weights as float32 would take {size(as_float32)} more and "
          f"{size(free)} is available ({size(CPU_HEADROOM)} of it kept for activations and the KV cache): they run "
          f"from their codes unpacked ({size(unpacked)} more), dequantized a "
          "slice at a time: the same results, slower" + ("" if unpacked <= room else "; even that does not fit: "
          "expect swapping or the OOM killer") + "; a GPU (--device cuda) keeps the weights packed", file=sys.stderr)


def check_gpu_memory(lm: LocalModel, dev: torch.device, context: int = 4096) -> None:
    """Refuse, in one line, a model that cannot fit with a KV cache of `context` tokens: bytes needed vs free, and
    the kv-bits setting that would fit (the cheaper change) or else the weight bit width."""
    free = gpu_free(dev)
    cfg = lm.model.cfg
    context = min(context, cfg.max_position_embeddings)
    sizes = lm.sizes()
    weights = sizes["gpu_bytes"] + WORKSPACE_BYTES
    kv = kvquant.bytes_per_token(cfg, lm.kv_bits) * context
    need = weights + kv
    if need <= free:
        return
    if weights + kvquant.bytes_per_token(cfg, min(kvquant.KV_BITS)) * context <= free:
        check_kv_cache(cfg, context, lm.kv_bits, free - weights)  # names the kv-bits setting that fits
    bits = lm.manifest["quant"]["bits"] if lm.manifest else 16
    linear = cfg.linear_weights
    fits = [b for b in (4, 3, 2) if b < bits and need - linear * (bits - b) / 8 <= free]
    hint = f"quantize it to {fits[0]} bits (localllm quantize --bits {fits[0]})" if fits else \
        "use a smaller model or the CPU (device='cpu')"
    raise LocalLLMError(f"{lm.path} needs {size(need)} of GPU memory ({size(sizes['gpu_bytes'])} weights, "
                        f"{size(kv)} KV cache for {context} tokens at {lm.kv_bits} bits) but {size(free)} is free; "
                        f"{hint}")


def check_shared_memory(lm: LocalModel, dev: torch.device) -> None:
    """Refuse, in one line, a model with a layer whose GEMV no variant runs within this GPU's shared memory per
    block (kernels.gemv.decode_variant)."""
    from .kernels import cuda
    from .kernels.gemv import decode_variant
    limit = cuda.shared_limit(dev.index or 0)
    for lin in (*lm.model.linears(), lm.model.head):
        if lin.quant is not None:
            try:
                decode_variant(lin.quant, limit)
            except LocalLLMError as e:
                raise LocalLLMError(f"{lm.path}: its {lin.kind} layers cannot run on this GPU: {e}") from None


def dense_model(ckpt: Checkpoint) -> Transformer:
    """The source checkpoint as a float32 decoder (the reference the quantized model is measured against); refused
    in one line where its float32 weights would not fit the host's available memory (on the meta device where the
    checkpoint is shapes_only)."""
    cfg, settings = ckpt.config, QdecSettings()
    if not ckpt.shapes_only:
        check_float32_fits(cfg, "`localllm quantize` it (that reads a block at a time) and run the quantized model")
    blocks = [build_block(cfg, i, ckpt.block_tensors(i), settings) for i in range(cfg.num_layers)]
    return Transformer(cfg, ckpt.embed(), blocks, RMSNorm(ckpt.final_norm(), cfg.rms_norm_eps), ckpt.lm_head(),
                       settings).eval()


def _dense(ckpt: Checkpoint, src) -> LocalModel:
    return LocalModel(dense_model(ckpt), ckpt.tokenizer, None, str(src), ckpt.eos_ids, source_files=ckpt.files)


def info(src: str | Path | None = None, gguf_file: str | None = None) -> dict:
    """What `localllm info` prints for any source load() takes. A source checkpoint is described from its config and
    its tensors' names (a GGUF's: those its config calls for), its model built on the meta device, no weight read: an
    8B checkpoint would take minutes and 32 GB of float32 to load."""
    if isinstance(src, (str, os.PathLike)) and src != "":  # else load's refusals
        check_path_text(src)
        if not is_model_folder(Path(src).expanduser()):
            return describe(_dense(open_checkpoint(src, gguf_file, shapes_only=True), src))
    return describe(load(src, gguf_file=gguf_file))


# a checkpoint as loaded (a GGUF too: its low-bit blocks are dequantized on load)
DENSE_LABEL = "16 (dense as loaded: `localllm quantize` makes a low-bit model with QDEC residuals)"


def describe(lm: LocalModel) -> dict:
    """What `localllm info` prints."""
    m = lm.manifest or {}
    c = lm.model.cfg
    return {
        "path": lm.path,
        "architecture": f"{c.model_type}: {c.num_layers} layers, hidden {c.hidden_size}, heads {c.num_heads}/"
                        f"{c.num_kv_heads} (q/kv), vocab {c.vocab_size}",
        "parameters": c.parameters,  # the source checkpoint's (a tied head is its embeddings)
        "bits": m["quant"]["bits"] if m else 16,
        "quantization": modelfile.quant_label(m["quant"]) if m else DENSE_LABEL,
        "awq": modelfile.awq_summary(m["quant"]) if m else None,
        "group_size": m["quant"]["group_size"] if m else None,
        "head": (m["quant"].get("head") or None) if m else None,  # None: fp16 (or tied to the embeddings)
        "residuals": m.get("residual"),
        "calibration": m.get("calibration"),
        "quantized_on": m.get("quantized_on"),  # where and how long (files from before session 39 lack it)
        "source": m.get("source", {"path": lm.path}),
        "model_id": m.get("model_id"),
        **lm.sizes(),
        "kv_cache": {"bits": lm.kv_bits, "bytes_per_token": {b: kvquant.bytes_per_token(c, b) for b in kvquant.KV_BITS},
                     "cpu_bytes_per_token_16": kvquant.bytes_per_token(c, 16, cpu=True),  # float32 on the CPU
                     "smooth_attention": m.get("smooth_attention")},
        # file -> the GPU and budget of a profile this model can run, or why it is not one
        "tuning_profiles": tuning.listing(lm.path, m.get("model_id"), m["calibration"].get("kmax", 0),
                                          c.num_layers) if m else {},
        "qdec": {"mode": lm.settings.mode, "k_chunk": lm.settings.k_chunk, "source": lm.qdec_source,
                 "blocks": {k: sorted(b) for k, b in lm.settings.blocks.items()}},
    }
