"""generate(): sampling semantics, determinism, streaming, stop strings, chat templates."""
import pytest
import torch

from localllm.errors import LocalLLMError
from localllm.generate import encode_prompt, generate
from localllm.runtime import load
from localllm.sampling import SamplingParams, next_token, nucleus


def probabilities(logits, seen, params):
    """nucleus()'s distribution over the token ids (float64 [V]), with its invariants checked."""
    order, e, c, n = nucleus(logits, seen, params.tensor())
    assert e[0] == 1 and torch.all(e[1:] <= e[:-1]) and torch.all(e >= 0)  # largest first, relative to the largest
    assert torch.allclose(c, e.cumsum(-1)) and 1 <= int(n) <= len(e)
    assert torch.equal(order.sort().values, torch.arange(len(e)))
    p = torch.zeros(len(e), dtype=torch.float64)
    p[order[:n]] = e[:n].double() / e[:n].double().sum()
    return p


LATER = "another reply on this model began, or its QDEC or KV cache setting changed, before this stream ended"


@pytest.fixture(scope="module")
def lm(tiny_quant):
    return load(tiny_quant)


@pytest.mark.parametrize("V,top_p", [(4, 0.5), (2, 0.5), (4, 0.75), (8, 0.25), (300, 0.5), (8, 1.0)])
def test_top_p_keeps_what_transformers_keeps_at_an_exact_boundary(V, top_p):
    """Equal logits put the mass before a token exactly at top_p: that token goes, as in transformers' TopPLogitsWarper
    ([1, 1, 1, 1] at top_p 0.5 keeps two tokens, not three)."""
    from transformers.generation.logits_process import TopPLogitsWarper
    logits = torch.full((V,), 0.37)
    want = TopPLogitsWarper(top_p)(None, logits[None].clone())[0] if top_p < 1 else logits
    got = probabilities(logits, torch.zeros(V, dtype=torch.bool), SamplingParams(1.0, top_p))
    assert int((got > 0).sum()) == int(torch.isfinite(want).sum()) == max(1, round(V * top_p))


@pytest.mark.parametrize("params", [SamplingParams(1.0, 1.0, 0, 1.3), SamplingParams(0.7, 0.9, 0, 1.0),
                                    SamplingParams(1.3, 1.0, 20, 1.0), SamplingParams(0.8, 0.5, 50, 0.8),
                                    SamplingParams(1.0, 1.0, 0, 1.0, 0.1), SamplingParams(1.5, 0.95, 0, 1.2, 0.05),
                                    SamplingParams(1.2, 0.6, 40, 1.0, 0.02), SamplingParams(0.9, 0.5, 0, 1.0, 1e-3),
                                    SamplingParams(1.0, 0.9, 0, 1.0, 1.0)])
def test_warp_matches_transformers_processors(params):
    """The kept tokens and their probabilities are transformers' (its processors in generate's order: min-p after
    top-p, so that either can cut first: min_p 0.1 with top-p off, 1e-3 under top-p 0.5)."""
    from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    V = 500
    logits = torch.randn(V) * 3
    ctx = torch.randint(0, V, (30,))
    seen = torch.zeros(V, dtype=torch.bool)
    seen[ctx] = True
    want = logits[None].clone()
    procs = [RepetitionPenaltyLogitsProcessor(params.repetition_penalty), TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        procs.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        procs.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0:
        procs.append(MinPLogitsWarper(params.min_p))
    for proc in procs:
        want = proc(ctx[None], want)
    got = probabilities(logits, seen, params)
    assert torch.equal(got == 0, torch.isinf(want[0]))
    assert torch.allclose(got, want[0].double().softmax(-1), atol=1e-6)


@pytest.mark.parametrize("params", [SamplingParams(1.0, 1.0, 0, 1.0), SamplingParams(0.7, 0.9, 0, 1.2),
                                    SamplingParams(1.3, 0.95, 20, 1.0), SamplingParams(1.3, 0.95, 0, 1.0, 0.05)])
def test_next_token_draws_each_token_with_its_probability(params):
    """Evenly spaced draws u pick each token as often as nucleus()'s distribution says (inverse CDF): the counts of
    M draws are within one of M * p."""
    V, M = 300, 20000
    logits, seen = torch.randn(V) * 2, torch.rand(V) < 0.1
    p = probabilities(logits, seen, params)
    counts = torch.zeros(V, dtype=torch.float64)
    for u in (torch.arange(M, dtype=torch.float64) + 0.5) / M:
        counts[next_token(logits, seen, params.tensor(), u.float(), greedy=False)] += 1
    assert (counts - M * p).abs().max() <= 1.5
    assert counts[p == 0].sum() == 0


def test_greedy_next_token_is_the_penalized_argmax():
    V = 1000
    logits, seen = torch.randn(V), torch.zeros(V, dtype=torch.bool)
    top = int(logits.argmax())
    assert int(next_token(logits, seen, SamplingParams(0.0).tensor(), torch.tensor(0.3), greedy=True)) == top
    seen[top] = True  # a penalty of 1e3 pushes it below the second largest
    got = next_token(logits, seen, SamplingParams(0.0, 1.0, 0, 1e3).tensor(), torch.tensor(0.3), greedy=True)
    want = int(torch.where(seen, torch.where(logits > 0, logits / 1e3, logits * 1e3), logits).argmax())
    assert int(got) == want != top


@pytest.mark.parametrize("params", [SamplingParams(0.0, 1.0, 0, 1.2), SamplingParams(0.9, 0.9, 40, 1.1)])
def test_decoder_generates_what_step_by_step_sampling_gives(lm, params):
    """Decoder.start/advance/read (the generation loop, the next token chosen inside the step) give the tokens of a
    plain loop: step() for the logits, next_token on the same draws, the repetition mask kept by hand."""
    ids, n = encode_prompt(lm, "The river ran"), 12
    draws = torch.rand(n, generator=torch.Generator().manual_seed(5))
    V = lm.model.cfg.vocab_size
    seen = torch.zeros(V, dtype=torch.bool)
    seen[torch.tensor(ids)] = True
    dec = lm.decoder(len(ids) + n)
    with torch.inference_mode():
        dec.start(dec.prefill(ids), len(ids), seen, params, draws)
        got = [dec.read()()]
        for _ in range(n - 1):
            dec.advance()
            got.append(dec.read()())
        logits, want, mask = dec.prefill(ids), [], seen.clone()
        for i in range(n):
            t = int(next_token(logits, mask, params.tensor(), draws[i], params.greedy))
            want.append(t)
            mask[t] = True
            logits = dec.step(torch.tensor(t), len(ids) + i)
    assert got == want


def test_greedy_matches_transformers_generate(tiny_ckpt):
    from transformers import AutoModelForCausalLM
    lm = load(tiny_ckpt)
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()
    ids = encode_prompt(lm, "The river ran")
    # 20 tokens whatever they are, on both sides: no end-of-sequence token (min_new_tokens would instead forbid the
    # EOS token on transformers' side alone, and a tiny random model's argmax is sometimes that token)
    ref.generation_config.eos_token_id = None
    want = ref.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    assert len(want) == 20
    lm.eos_ids = []
    got = lm.tokenizer(generate(lm, "The river ran", max_new_tokens=20, temperature=0),
                       add_special_tokens=False)["input_ids"]
    assert lm.tokenizer.decode(got) == cut(lm.tokenizer.decode(want, skip_special_tokens=True))


def cut(text: str) -> str:
    """What generate shows of a reply's text: not a last character whose bytes had not all come when it ended
    (decoded, one U+FFFD)."""
    return text[:-1] if text.endswith("\ufffd") else text


def test_repetition_penalty_over_the_prompt_matches_transformers(tiny_ckpt):
    """The penalty covers the prompt's tokens too, as transformers' does: prompts that repeat the model's own greedy
    reply, where the penalty changes what comes next."""
    from transformers import AutoModelForCausalLM
    lm = load(tiny_ckpt)
    lm.eos_ids = []
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    tried = 0
    for start in ("The river ran", "Hello", "Once upon a time", "1 2 3", "a b", "Yes", "x", "We"):
        for n in range(2, 17, 2):
            prompt = start + generate(lm, start, max_new_tokens=n, temperature=0)
            ids = encode_prompt(lm, prompt)
            with torch.no_grad():
                if int(lm.model(torch.tensor([ids]))[0, -1].argmax()) not in ids:
                    continue  # only prompts whose own tokens the model would repeat next test the prompt's part
            want = ref.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, repetition_penalty=5.0,
                                pad_token_id=0)[0, len(ids):].tolist()
            got = generate(lm, prompt, max_new_tokens=8, temperature=0, repetition_penalty=5.0)
            assert got == cut(lm.tokenizer.decode(want, skip_special_tokens=True)), prompt
            tried += 1
    assert tried >= 2, tried


def test_seed_determinism_and_streaming(lm, monkeypatch):
    monkeypatch.setattr(lm, "eos_ids", [])  # a random model may draw its end-of-sequence token first
    kw = dict(max_new_tokens=30, temperature=1.0, top_p=1.0)
    a = generate(lm, "Once upon a time", seed=7, **kw)
    b = generate(lm, "Once upon a time", seed=7, **kw)
    s = generate(lm, "Once upon a time", seed=7, stream=True, **kw)
    pieces = list(s)
    assert a == b == "".join(pieces)
    assert len(pieces) > 1 and s.stats.new_tokens == 30 and s.stats.finish_reason == "length"
    others = {generate(lm, "Once upon a time", seed=seed, **kw) for seed in range(1, 6)}
    assert len(others) > 1


def test_warm_up_is_nothing_to_do_on_the_cpu(lm):
    lm._decoder = None
    lm.warm_up(64)
    assert lm._decoder is None  # no graphs to capture; a reply makes its Decoder as before


def test_stop_string_ends_the_text_before_it(lm):
    lm.eos_ids = []
    full = generate(lm, "Hello", max_new_tokens=40, temperature=0, seed=3)
    assert len(full) > 10
    stop = full[len(full) // 2: len(full) // 2 + 3]
    s = generate(lm, "Hello", max_new_tokens=40, temperature=0, seed=3, stop=[stop], stream=True)
    out = "".join(s)
    assert out == full[: full.index(stop)] and s.stats.finish_reason == "stop"


def test_streaming_holds_back_what_could_begin_a_stop_string():
    from localllm.generate import _ready
    assert _ready("abc", []) == 3 and _ready("ab\ufffd\ufffd", []) == 2
    assert _ready("say u", ["uvw"]) == 4 and _ready("say uv", ["uvw", "x"]) == 4
    # the stop's next character still incomplete (U+FFFD): "u" may yet begin it
    assert _ready("say u\ufffd", ["u\u052bZ"]) == 4
    assert _ready("say u\ufffd", ["abc"]) == 5


def test_eos_shows_what_was_held_back(lm, monkeypatch):
    """Text held back while it could still begin a stop string is shown when the reply ends without one."""
    import importlib
    g = importlib.import_module("localllm.generate")  # the module (the package exports its function by that name)
    for prompt in ("Hello", "The river ran", "Once upon a time", "1 2 3"):  # one whose greedy reply varies
        lm.eos_ids = []
        g.generate(lm, prompt, max_new_tokens=8, temperature=0)
        made = lm.cached_tokens()[len(g.encode_prompt(lm, prompt)):]  # the reply's tokens run (all but the last)
        # a token new to the reply, with text before it (a random model may draw special tokens, which show none)
        k = next((i for i in range(1, len(made)) if made[i] not in made[:i]
                  and cut(lm.tokenizer.decode(made[:i], skip_special_tokens=True))), None)
        if k is not None:
            break
    lm.eos_ids = [made[k]]
    want = g.generate(lm, prompt, max_new_tokens=8, temperature=0)
    monkeypatch.setattr(g, "_ready", lambda text, stops: 0)  # everything held back until the end
    s = g.generate(lm, prompt, max_new_tokens=8, temperature=0, stream=True)
    assert want and "".join(s) == want and s.stats.finish_reason == "eos" and s.stats.new_tokens == k


def forced(lm, monkeypatch, token: int, after: int) -> None:
    """From the model's (after + 1)-th output on, `token` is the most likely by far."""
    head, calls = lm.model.head, [0]

    def forward(*a, **k):
        y = type(head).forward(head, *a, **k)
        calls[0] += 1
        if calls[0] > after:
            y[..., token] += 1e4
        return y
    monkeypatch.setattr(head, "forward", forward)


def test_a_stop_string_that_is_a_special_token_ends_the_reply_at_it(lm, monkeypatch):
    """Special tokens decode to no text, so a stop string that is one's text ("<|user|>") ends the reply as that
    token, with the text before it shown."""
    lm.eos_ids = []
    user = lm.tokenizer.convert_tokens_to_ids("<|user|>")
    generate(lm, "Hello", max_new_tokens=5, temperature=0)
    natural = lm.cached_tokens()[len(encode_prompt(lm, "Hello")):]  # the reply's first 4 tokens
    k = natural.index(user) if user in natural else 4  # (a random model may draw <|user|> itself: it ends there)
    want = generate(lm, "Hello", max_new_tokens=k, temperature=0) if k else ""  # the text before it
    forced(lm, monkeypatch, user, 4)  # the prompt's output and three steps as before, then <|user|>
    s = generate(lm, "Hello", max_new_tokens=12, temperature=0, stop=["<|user|>"], stream=True)
    assert "".join(s) == want and s.stats.finish_reason == "stop" and s.stats.new_tokens == k
    lm.eos_ids = [user]  # the model's end token too (the demo's <|im_end|>): the stop the caller named is said
    forced(lm, monkeypatch, user, 4)
    s = generate(lm, "Hello", max_new_tokens=12, temperature=0, stop=["<|user|>"], stream=True)
    assert "".join(s) == want and s.stats.finish_reason == "stop"
    lm.eos_ids = []


def test_a_cpu_reply_runs_no_step_past_its_end(lm, monkeypatch):
    """On the CPU each step runs when its token is asked for: a reply that ends at its third token ran two steps
    after the prompt (on a GPU the next step is queued ahead, where it costs nothing)."""
    from localllm.decode import Decoder
    steps, advance = [0], Decoder.advance

    def counted(self):
        steps[0] += 1
        advance(self)
    monkeypatch.setattr(Decoder, "advance", counted)
    end = lm.tokenizer.convert_tokens_to_ids("<|end|>")
    lm.eos_ids = [end]
    forced(lm, monkeypatch, end, 2)
    s = generate(lm, "Hello", max_new_tokens=12, temperature=0, stream=True)
    "".join(s)
    assert s.stats.finish_reason == "eos" and s.stats.new_tokens == 2 and steps[0] == 2


def test_eos_ends_generation(lm):
    lm.eos_ids = list(range(lm.model.cfg.vocab_size))  # every token ends it
    s = generate(lm, "Hi", max_new_tokens=10, stream=True)
    assert "".join(s) == "" and s.stats.finish_reason == "eos"


def test_chat_messages_use_the_template(lm):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    want = lm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert lm.tokenizer.decode(encode_prompt(lm, msgs)) == want
    assert isinstance(generate(lm, msgs, max_new_tokens=5), str)


def test_qdec_changes_output_and_is_deterministic(lm):
    kw = dict(max_new_tokens=12, temperature=0)
    lm.eos_ids = []
    off = load(lm.path, qdec="off")
    off.eos_ids = []
    a = generate(lm, "The", qdec={"mode": "exact", "k_chunk": 64}, **kw)
    assert a == generate(lm, "The", qdec={"mode": "exact", "k_chunk": 64}, **kw)
    t = torch.randint(0, lm.model.cfg.vocab_size, (1, 16))
    with torch.no_grad():
        assert not torch.equal(lm.model(t), off.model(t))


def test_bad_arguments_are_refused(lm):
    with pytest.raises(LocalLLMError, match="temperature"):
        generate(lm, "x", temperature=-1)
    with pytest.raises(LocalLLMError, match="temperature"):
        generate(lm, "x", temperature=float("nan"))
    with pytest.raises(LocalLLMError, match="k_chunk"):
        generate(lm, "x", qdec=5000)
    with pytest.raises(LocalLLMError, match="mode"):
        generate(lm, "x", qdec={"mode": "magic"})
    with pytest.raises(LocalLLMError, match="unknown keys mdoe"):
        generate(lm, "x", qdec={"k_chunk": 4, "mdoe": "exact"})
    wrong = [dict(seed=True), dict(seed=1.5), dict(max_new_tokens=2.5), dict(max_new_tokens=True), dict(top_k=2.5),
             dict(stop=5), dict(stop=["a", None]), dict(temperature="0.7"), dict(top_p=None),
             dict(temperature=float("inf")), dict(temperature=1e39), dict(repetition_penalty=float("inf"))]  # (float32)
    for kw in wrong:
        with pytest.raises(LocalLLMError, match=next(iter(kw))):
            generate(lm, "x", **kw)
    for prompt in (None, 123, b"x", []):
        with pytest.raises(LocalLLMError, match="prompt must be a string or a non-empty list of chat messages"):
            generate(lm, prompt)
    for prompt in ([{"role": "user"}], ["hi"]):
        with pytest.raises(LocalLLMError, match="chat message 0 must be a dict with 'role' and 'content'"):
            generate(lm, prompt)


def test_the_qdec_setting_in_force_asked_again_keeps_the_kv_cache_and_a_refused_one_changes_nothing(tiny_quant):
    lm = load(tiny_quant)
    lm.eos_ids = []
    msgs = [{"role": "user", "content": "Hello there"}]
    reply = generate(lm, msgs, max_new_tokens=4, temperature=0, reuse_cache=True)
    msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    s = generate(lm, msgs, max_new_tokens=4, temperature=0, reuse_cache=True, stream=True, qdec="on")  # as it is
    s.text()
    assert s.stats.cached_tokens > 0  # the cache kept: only the new turn read
    kept, budget = len(lm.cached_tokens()), lm.budget
    for bad in ("bogus", {"k_chunk": 4, "mdoe": "exact"}, 5000):
        with pytest.raises(LocalLLMError):
            lm.set_qdec(bad, budget=0.2)
        assert len(lm.cached_tokens()) == kept and lm.budget == budget
    lm.settings.mode = "off"  # changed by hand: "on" asked again is applied again
    lm.set_qdec("on")
    assert lm.settings.mode == "approx" and lm.cached_tokens() == []
    with pytest.raises(LocalLLMError, match="prefill_int8='no': give True or False"):
        load(tiny_quant, prefill_int8="no")


def test_a_model_without_residuals_refuses_a_qdec_it_cannot_run(tiny_ckpt):
    with pytest.raises(LocalLLMError, match="has no QDEC residuals"):
        load(tiny_ckpt, qdec=16)
    with pytest.raises(LocalLLMError, match="is not understood"):
        load(tiny_ckpt, qdec="bogus")
    assert load(tiny_ckpt, qdec="on").settings.mode == "off"


def test_numpy_numbers_are_numbers(lm):
    """Whole and real numbers of numpy's kinds pass where Python's do (a sweep script's np.arange, np.float32)."""
    import numpy as np
    from localllm.runtime import _check_budget
    lm.set_qdec({"mode": "approx", "k_chunk": np.int64(8), "n_tb": np.int64(4)})
    assert lm.settings.mode == "approx" and lm.settings.k_chunk["gate_up"] == 8
    _check_budget(np.float32(0.05))
    generate(lm, "x", max_new_tokens=np.int64(2), temperature=np.float32(0.5), top_p=np.float64(0.9), top_k=np.int32(5),
             seed=np.int64(1))
    lm.set_qdec("on")


def test_a_refused_call_changes_nothing_about_the_model(lm):
    """Every argument is checked before generate() applies qdec or kv_bits to the model."""
    mode, kv = lm.settings.mode, lm.kv_bits
    generate(lm, "The river ran", max_new_tokens=3, temperature=0)
    cached = lm.cached_tokens()
    assert cached
    limit = lm.model.cfg.max_position_embeddings
    calls = [("x", dict(temperature=-1)), ("x", dict(seed=-3)), ("x", dict(max_new_tokens=0)), ("x", dict(stop=5)),
             ("x", dict(cancel=True)), ("x", dict(stream="no")), ("x", dict(reuse_cache="no")), ("x", dict(kv_bits=8.0)),
             ("", {}), ([{"role": "user", "content": None}], {}), ("one " * limit, {}),
             ("\udcff", {})]  # (not UTF-8: a byte that decodes to no character)
    for prompt, kw in calls:
        with pytest.raises(LocalLLMError):
            generate(lm, prompt, **{"qdec": "off" if mode != "off" else 8, "kv_bits": 8 if kv != 8 else 16, **kw})
        assert (lm.settings.mode, lm.kv_bits, lm.cached_tokens()) == (mode, kv, cached), (prompt[:10], kw)


def test_an_empty_stop_string_is_ignored(lm):
    lm.eos_ids = []
    kw = dict(max_new_tokens=12, temperature=0)
    want = generate(lm, "The river ran", **kw)
    assert want and generate(lm, "The river ran", stop="", **kw) == want
    assert generate(lm, "The river ran", stop=[""], **kw) == want


def test_a_tiny_temperature_chooses_greedily(lm):
    """Temperatures below GREEDY_BELOW are greedy, their limit (1e-40 divided float32 logits into inf and NaN)."""
    lm.eos_ids = []
    kw = dict(max_new_tokens=12, top_p=1.0, seed=4)
    greedy = generate(lm, "The river ran", temperature=0, **kw)
    assert generate(lm, "The river ran", temperature=1e-40, **kw) == greedy
    assert generate(lm, "The river ran", temperature=1e-5, **kw) == greedy


def test_a_later_reply_stops_an_open_stream_and_threads_take_turns(lm):
    """Replies share the model's KV cache: a stream still open when another reply begins stops at its next piece
    with an error (it wrote into the new reply's cache before), the new reply is what it is alone, and replies from
    two threads wait for each other."""
    import threading
    lm.eos_ids = []
    kw = dict(max_new_tokens=16, temperature=1.0, top_p=1.0)
    alone = {p: generate(lm, p, seed=2, **kw) for p in ("Once upon a time", "The river ran")}
    first = iter(generate(lm, "Once upon a time", seed=2, stream=True, **kw))
    got = next(first)
    assert alone["Once upon a time"].startswith(got)
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled(), "the caller's mode between pieces"
    second = generate(lm, "The river ran", seed=2, stream=True, **kw)
    it = iter(second)
    text = next(it)
    with pytest.raises(LocalLLMError, match=LATER):
        next(first)
    assert text + "".join(it) == alone["The river ran"]
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled(), "no stale mode restored"
    # a stream not read yet when another reply is asked for raises too (it would run with that call's settings)
    unread = generate(lm, "Once upon a time", seed=2, stream=True, **kw)
    generate(lm, "The river ran", max_new_tokens=1)
    with pytest.raises(LocalLLMError, match=LATER):
        unread.text()
    assert unread.stats.finish_reason == "cancelled"
    out = {}

    def run(p):
        out[p] = [generate(lm, p, seed=2, **kw) for _ in range(3)]

    threads = [threading.Thread(target=run, args=(p,)) for p in alone]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == {p: [want] * 3 for p, want in alone.items()}
    # a setting changed while a stream is open ends it too (its cache is gone); the same setting again does not
    for change in (lambda: lm.set_kv_bits(8 if lm.kv_bits == 16 else 16), lambda: lm.set_qdec("off")):
        open_ = iter(generate(lm, "Once upon a time", seed=2, stream=True, **kw))
        next(open_)
        change()
        with pytest.raises(LocalLLMError, match=LATER):
            next(open_)
    open_ = iter(generate(lm, "Once upon a time", seed=2, stream=True, **kw))
    next(open_)
    lm.set_qdec("off")  # already so
    assert "".join(open_)
    # from another thread, a setting waits for a reply's step: a reply runs whole under one setting
    lm.set_kv_bits(16)
    lm.set_qdec("on")
    on = generate(lm, "Once upon a time", seed=2, **{**kw, "max_new_tokens": 48})
    lm.set_qdec("off")
    off = generate(lm, "Once upon a time", seed=2, **{**kw, "max_new_tokens": 48})
    lm.set_qdec("on")
    started, got = threading.Event(), []

    def reply():
        s = generate(lm, "Once upon a time", seed=2, stream=True, **{**kw, "max_new_tokens": 48})
        with lm.lock:  # (the reply holds the lock at each step: the setting can only come between them)
            started.set()
            got.append(next(iter(s)))
        try:
            got.extend(s)
        except LocalLLMError:
            got.append(None)
    t = threading.Thread(target=reply)
    t.start()
    started.wait()
    lm.set_qdec("off")
    t.join()
    assert got[-1] is None or "".join(got) in (on, off), "never a reply that changed setting halfway"


def test_closing_a_stream_stops_it_and_the_model_goes_on(lm):
    lm.eos_ids = []
    kw = dict(max_new_tokens=30, temperature=1.0, seed=11)
    full = generate(lm, "Once upon a time", **kw)
    s = generate(lm, "Once upon a time", stream=True, **kw)
    it = iter(s)
    first = [next(it) for _ in range(3)]
    s.close()
    assert s.stats.finish_reason == "cancelled" and 3 <= s.stats.new_tokens < 30 and s.stats.decode_seconds > 0
    assert full.startswith("".join(first)) and list(it) == []
    assert generate(lm, "Once upon a time", **kw) == full  # the decoder kept no state from the closed stream
    done = generate(lm, "Once upon a time", stream=True, **kw)
    done.text()
    done.close()  # closing a finished stream changes nothing
    assert done.stats.finish_reason == "length"


class SetAfter:
    """An Event-like flag that reads set from its n-th look on: where in the work a cancel lands."""

    def __init__(self, n: int):
        self.n, self.looks = n, 0

    def is_set(self) -> bool:
        self.looks += 1
        return self.looks >= self.n


def test_cancel_stops_the_prompt_between_layers_and_the_reply_between_tokens(lm):
    lm.eos_ids = []
    kw = dict(max_new_tokens=30, temperature=1.0, seed=5)
    full = generate(lm, "Once upon a time", **kw)
    layers = lm.model.cfg.num_layers
    during = SetAfter(layers)  # set before the last layer of the prompt
    s = generate(lm, "Once upon a time", stream=True, cancel=during, **kw)
    assert s.text() == "" and s.stats.finish_reason == "cancelled" and s.stats.new_tokens == 0
    assert during.looks == layers  # it stopped there, not after the whole prompt
    after = SetAfter(layers + 4)  # the prompt's layers, then 3 tokens
    s = generate(lm, "Once upon a time", stream=True, cancel=after, **kw)
    text = s.text()
    assert s.stats.finish_reason == "cancelled" and s.stats.new_tokens == 3 and full.startswith(text)
    assert generate(lm, "Once upon a time", **kw) == full  # the model goes on as before


def test_reuse_cache_reads_only_what_the_kv_cache_lacks(tiny_quant):
    """reuse_cache: a chat's next turn is read from the first token the cache does not hold (it holds the previous
    prompt and the reply's tokens that were run); the logits are those of reading the whole prompt up to rounding
    (QDEC off here: its selection can carry rounding into other channels); the same calls give the same text; a
    prompt cancelled midway leaves the cache holding what it held up to where the new prompt differs."""
    from localllm.decode import Decoder
    from localllm.errors import Cancelled
    lm = load(tiny_quant, qdec="off")
    lm.eos_ids = []
    kw = dict(max_new_tokens=12, temperature=1.0, seed=2, stream=True, reuse_cache=True)
    msgs = [{"role": "user", "content": "Hello"}]
    s = generate(lm, msgs, **kw)
    reply = s.text()
    first, dec = encode_prompt(lm, msgs), lm._decoder
    assert s.stats.cached_tokens == 0 and len(dec.cached()) == len(first) + 11  # the last token chosen is not run
    assert dec.cached()[:len(first)] == first
    msgs2 = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "More"}]
    shared = len(dec.cached())  # the text of a random model's tokens may tokenize anew otherwise: ids held whole
    ids = dec.cached() + encode_prompt(lm, msgs2)[-5:]
    with torch.inference_mode():
        got = dec.prefill(ids, reuse=True)
        want = Decoder(lm.model, dec.max_len).prefill(ids)
    assert dec.reused == shared and dec.cached() == ids
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    other = ids[:shared + 2] + [(ids[shared + 2] + 1) % lm.model.cfg.vocab_size]
    with torch.inference_mode(), pytest.raises(Cancelled):
        dec.prefill(other, cancel=SetAfter(2), reuse=True)
    assert dec.cached() == ids[:shared + 2]  # what it still holds truly

    texts = []
    for _ in range(2):  # QDEC on: the same calls, the same texts
        lm = load(tiny_quant)
        lm.eos_ids = []
        reply = generate(lm, msgs, **kw).text()
        s = generate(lm, msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "More"}], **kw)
        texts.append((reply, s.text()))
        assert s.stats.cached_tokens >= len(first)
    assert texts[0] == texts[1]
    assert generate(lm, msgs, max_new_tokens=12, temperature=1.0, seed=2, stream=True).stats.cached_tokens == 0


def test_a_chat_keeps_its_replies_tokens_and_a_cache_it_outgrows(tiny_quant):
    """The next turn's prompt holds the previous reply as the tokens the model made where they are not the canonical
    tokenization of its text (here one token a character), with the same text; an edited reply is tokenized as
    before. A turn longer than the KV cache gets a larger one holding the old one's entries: it reads only what is
    new, and the kept keys and values are those of reading the whole prompt, up to rounding."""
    from localllm.decode import Decoder
    from localllm.generate import _encode
    lm = load(tiny_quant, qdec="off")
    lm.eos_ids = []
    tok = lm.tokenizer
    msgs = [{"role": "user", "content": "Hello"}]
    reply = "Hello there"
    held = _encode(lm, msgs) + [t for c in reply for t in tok(c, add_special_tokens=False)["input_ids"]]
    msgs2 = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "More"}]
    plain = _encode(lm, msgs2)
    assert plain[:len(held)] != held  # tokenized anew, the reply's text is other tokens
    ids = encode_prompt(lm, msgs2, held)
    assert ids[:len(held)] == held and tok.decode(ids) == tok.decode(plain)
    edited = msgs + [{"role": "assistant", "content": "Hello thorn"}, {"role": "user", "content": "More"}]
    assert encode_prompt(lm, edited, held) == _encode(lm, edited)
    assert encode_prompt(lm, "Hello there", held) == _encode(lm, "Hello there")  # plain prompts as they are

    lm._decoder = dec = Decoder(lm.model, 96)  # below the 256 tokens a first reply's cache is rounded up to
    with torch.inference_mode():
        dec.prefill(held)  # as a reply of those tokens leaves it
    s = generate(lm, msgs2, max_new_tokens=dec.max_len + 1 - len(ids), temperature=1.0, seed=7, stream=True,
                 reuse_cache=True)
    assert next(iter(s))  # the prompt is read
    new, n = lm._decoder, len(held)
    assert new is not dec and new.max_len > dec.max_len and s.stats.cached_tokens == n
    want = Decoder(lm.model, new.max_len)
    with torch.inference_mode():
        want.prefill(ids)
    for a, b in ((new.cache.k, want.cache.k), (new.cache.v, want.cache.v)):
        assert torch.allclose(a[:, :, :, :n], b[:, :, :, :n], rtol=1e-4, atol=1e-4 * b.abs().max().item())
    s.text()


def test_a_prompt_read_on_the_cpu_shows_its_progress(lm, monkeypatch):
    """A prompt on the CPU is read under a progress bar over the layers, once it has taken BLOCKS_BAR_DELAY seconds
    (here at once); the reply's tokens are not."""
    from localllm import model as model_mod
    from localllm.progress import observe
    monkeypatch.setattr(model_mod, "BLOCKS_BAR_DELAY", 0)
    lm.model.make_ready()  # (the weights' CPU form has a bar of its own)
    seen = []
    with observe(lambda *a: seen.append(a)):
        s = generate(lm, "Once upon a time", max_new_tokens=4, stream=True)
        s.text()
    layers = lm.model.cfg.num_layers
    bars = {a[0] for a in seen}
    assert bars == {f"reading the prompt ({s.stats.prompt_tokens} tokens)"}
    assert seen[-1][1:] == (layers, layers, "layer")


def test_a_full_context_ends_the_reply_and_says_so(lm):
    lm.eos_ids = []
    limit = lm.model.cfg.max_position_embeddings
    words = next(n for n in range(limit, 0, -1) if len(encode_prompt(lm, "one two " * n)) < limit - 5)
    text = "one two " * words  # a prompt a little short of the context
    s = generate(lm, text, stream=True, max_new_tokens=50, seed=1)
    s.text()
    prompt = s.stats.prompt_tokens
    assert s.stats.finish_reason == "context" and s.stats.new_tokens == limit - prompt > 0
    s = generate(lm, text, stream=True, max_new_tokens=limit - prompt, seed=1)
    s.text()
    assert s.stats.finish_reason == "length"  # max_new_tokens reached as the context fills: the user's limit
    with pytest.raises(LocalLLMError, match=f"tokens; this model's context is {limit}: shorten it"):
        generate(lm, text * 2, max_new_tokens=1)
    lm.model.cfg.sliding_window = limit  # a Mistral-style window that set the context: the message says so
    try:
        with pytest.raises(LocalLLMError, match=f"context is {limit} \\(its sliding-window attention's window"):
            generate(lm, text * 2, max_new_tokens=1)
    finally:
        lm.model.cfg.sliding_window = 0


def test_decoder_is_kept_and_grows_geometrically(lm, monkeypatch):
    """A chat's history grows each turn: the runtime keeps its Decoder while it is long enough and, past it, at least
    doubles it (each new one costs a CUDA-graph capture on a GPU), up to the model's context; on the CPU one far
    longer than a fresh reply needs is let go."""
    limit = lm.model.cfg.max_position_embeddings
    monkeypatch.setattr(lm.model.cfg, "max_position_embeddings", 4096)  # (the tiny model's is 256)
    lm._decoder = None
    first = lm.decoder(100)
    assert first.max_len == 256 and lm.decoder(200) is first
    with torch.inference_mode():
        first.prefill([1, 2, 3])
    second = lm.decoder(300)  # (not keep: a reply that does not reuse the cache takes nothing from it)
    assert second is not first and second.max_len == 512
    assert second.cached() == []
    big = lm.decoder(2000)
    assert big.max_len == 2048 and lm.decoder(900) is big  # within twice the need: kept
    small = lm.decoder(100)  # on the CPU (no graph to keep) a cache over twice the need is made anew at the need
    assert small is not big and small.max_len == 256  # (one long request held its memory for every later reply)
    assert lm.decoder(1500).max_len == 1536 and lm.decoder(100, keep=True).max_len == 1536  # a chat's stays
    monkeypatch.undo()
    lm._decoder = None
    full = lm.decoder(limit + 1)  # more than the context: the context, and kept (eval's windows at --ctx = context)
    assert full.max_len == limit and lm.decoder(limit + 1) is full
    for pos in (-1, limit):  # a step outside the cache is refused, not written past it (a GPU graph would)
        with pytest.raises(ValueError, match=f"position {pos} is outside the KV cache"):
            full.step(torch.tensor(1), pos)


def test_decoder_spans_split_at_one_attention_chunk(lm):
    """The graphs' spans (decode.py): positions below SHORT_SPAN (one chunk of the decode attention, which then needs
    no merging kernel) and the rest of the cache; a cache no longer than a chunk has one span. (On a GPU with
    thread-block clusters two more, below PAIR_SPAN (two runs, merged by o's GEMV) and CLUSTER_SPAN (runs merged in
    their clusters); not on the CPU.)"""
    from localllm.decode import CLUSTER_SPAN, SHORT_SPAN, Decoder
    from localllm.kernels import attention
    assert SHORT_SPAN == attention.CHUNK and CLUSTER_SPAN == attention.CLUSTER_SPAN
    assert Decoder(lm.model, 2 * CLUSTER_SPAN).spans == [SHORT_SPAN, 2 * CLUSTER_SPAN]
    dec = Decoder(lm.model, SHORT_SPAN + 72)
    assert dec.spans == [SHORT_SPAN, SHORT_SPAN + 72]
    assert [dec.span(p) for p in (0, SHORT_SPAN - 1, SHORT_SPAN, SHORT_SPAN + 71)] == \
        [SHORT_SPAN] * 2 + [SHORT_SPAN + 72] * 2
    assert Decoder(lm.model, SHORT_SPAN).spans == [SHORT_SPAN] and Decoder(lm.model, 40).spans == [40]


def metaspace_tokenizer():
    """A SentencePiece-style BPE (a leading '▁' for a space, dropped at the start of a decoded text)."""
    from importlib import resources

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    text = resources.files("localllm").joinpath("data", "calibration.txt").read_text()
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(text.split("\n\n"), trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "</s>"]
                                                                    + bytes_, show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_detokenizer_gives_the_whole_decoding(kind):
    """Token by token, the incremental text is the whole list's decoding (random tokens split characters across
    tokens, leave invalid bytes behind, and special tokens decode to nothing)."""
    from conftest import make_tokenizer

    from localllm.generate import Detokenizer
    tok = make_tokenizer(384) if kind == "byte-level" else metaspace_tokenizer()
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for _ in range(20):
        ids = torch.randint(0, len(tok), (60,), generator=gen).tolist()
        if kind == "metaspace":  # real text too: words that start with '▁'
            ids = tok("Plants make sugar from light and water. " * 2)["input_ids"] + ids
        d = Detokenizer(tok)
        for i, t in enumerate(ids):
            assert d.add(t) == tok.decode(ids[:i + 1], skip_special_tokens=True), i


def test_arguments_of_the_wrong_kind_for_load_warm_up_and_model_are_refused_in_one_line(lm):
    import localllm
    for call, match in ((lambda: localllm.load(5), "load\\(\\) takes a model folder"),
                        (lambda: localllm.load(""), "load\\(\\) takes a model folder"),
                        (lambda: generate(5, "x"), "model must be what localllm.load\\(\\) returns"),
                        (lambda: generate(lm.model, "x"), "model must be what localllm.load\\(\\) returns"),
                        (lambda: lm.warm_up(-5), "warm_up takes"), (lambda: lm.warm_up("10"), "warm_up takes"),
                        (lambda: generate(lm, ["Hi"]), "chat message 0 must be a dict"),
                        (lambda: generate(lm, [{"role": "user", "content": "a"}, {"role": "user"}]),
                         "chat message 1 must be a dict with 'role' and 'content' \\(strings\\), got no 'content'"),
                        (lambda: generate(lm, [{"role": 5, "content": "a"}]), "chat message 0 .* got role int"),
                        (lambda: generate(lm, [{"content": "a"}]), "chat message 0 .* got no 'role'"),
                        (lambda: lm.set_qdec({"k_chunk": 4, "blocks": [1, 2]}), "QDEC blocks \\[1, 2\\] is not "
                                                                               "understood: give a dict")):
        with pytest.raises(LocalLLMError, match=match) as e:
            call()
        assert "\n" not in str(e.value)


def test_stats_counts_say_no_rate_for_a_one_token_reply():
    """One token has no decode step to time: no "0.0 tok/s" (nor "1 tokens")."""
    from localllm.generate import Stats
    assert Stats(new_tokens=1, decode_seconds=0.0).counts() == "1 token, - tok/s"
    assert Stats(new_tokens=5, decode_seconds=2.0).counts("—", " · ") == "5 tokens · 2.0 tok/s"


def test_a_reply_cut_short_by_ctrl_c_leaves_a_cache_that_the_next_prompt_can_reuse(lm, monkeypatch):
    """Ctrl+C inside a decode step: the token it was running is not counted as cached, so a prompt reusing the
    cache runs it again (it was counted, its keys and values unwritten, and the next reply read garbage)."""
    s = generate(lm, "The river ran", stream=True, max_new_tokens=30, temperature=0, reuse_cache=True)
    pieces = iter(s)
    next(pieces), next(pieces)
    dec = lm.decoder(1)  # the one the stream runs (large enough: kept)
    with monkeypatch.context() as mp:
        mp.setattr(dec, "model", lambda *a, **kw: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            for _ in pieces:
                pass
    ids = lm.cached_tokens() + [7]
    with torch.inference_mode():
        reused = dec.prefill(ids, reuse=True)
        assert dec.reused > 0
        fresh = dec.prefill(ids)
    torch.testing.assert_close(reused, fresh, rtol=1e-4, atol=1e-4)


def test_close_from_another_thread_ends_the_reply_at_its_next_step(lm, monkeypatch):
    """A UI thread closing a stream another thread reads (inside its next step): no 'generator already executing';
    the reader's stream ends after that step, cancelled, and the model serves the next reply."""
    import threading
    import time
    s = generate(lm, "The river ran", stream=True, max_new_tokens=40, temperature=0)
    from localllm.decode import Decoder
    got, inside = [], threading.Event()
    real = Decoder.advance

    def slow(self):  # each step takes a while, so that close() lands while the reader is inside one
        inside.set()
        time.sleep(0.02)
        return real(self)
    monkeypatch.setattr(Decoder, "advance", slow)
    reader = threading.Thread(target=lambda: got.extend(s))
    reader.start()
    assert inside.wait(10)
    s.close()
    reader.join(10)
    assert not reader.is_alive() and s.stats.finish_reason == "cancelled" and s.stats.new_tokens < 40
    monkeypatch.undo()
    assert generate(lm, "The river ran", max_new_tokens=3, temperature=0)


def test_no_seed_leaves_torchs_random_state_alone(lm):
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    generate(lm, "The river ran", max_new_tokens=2)
    assert torch.equal(torch.rand(3), want)


def test_encode_counts_what_generate_reads(lm):
    """LocalModel.encode: the ids a reply's prompt has (its stats say how many), refused as generate() refuses."""
    chat = [{"role": "user", "content": "The river ran"}]
    for prompt in (chat, "The river ran"):
        s = generate(lm, prompt, stream=True, max_new_tokens=2, temperature=0)
        s.text()
        assert len(lm.encode(prompt)) == s.stats.prompt_tokens > 0
    assert lm.encode(chat) != lm.encode("The river ran")  # the chat template's tokens
    assert lm.context_length == lm.model.cfg.max_position_embeddings
    with pytest.raises(LocalLLMError, match="chat message 0 must be a dict"):
        lm.encode([{"content": "x"}])


def test_a_reply_cut_inside_a_multi_byte_character_leaves_it_out(lm, monkeypatch):
    """A byte-level token that only begins a character (U+FFFD alone) as the reply's last: not shown as U+FFFD."""
    lm.eos_ids = []
    dec, V = lm.tokenizer.decode, lm.model.cfg.vocab_size
    a = next(t for t in range(V) if dec([t]).strip().isalpha())
    partial = next(t for t in range(V) if dec([t]) == "\ufffd")
    head, calls = lm.model.head, [0]

    def forward(*args, **kw):  # the reply: a, a, a, then the partial token
        y = type(head).forward(head, *args, **kw)
        calls[0] += 1
        y[..., a if calls[0] <= 3 else partial] += 1e4
        return y
    monkeypatch.setattr(head, "forward", forward)
    s = generate(lm, "Hello", max_new_tokens=4, temperature=0, stream=True)
    assert dec([a, a, a, partial]).endswith("\ufffd")
    assert s.text() == dec([a, a, a]) and s.stats.finish_reason == "length" and s.stats.new_tokens == 4


def test_only_what_may_be_sent_must_fit_the_context(lm, monkeypatch):
    """A chat's earlier replies go as the model's own tokens (_splice), which can be fewer than their text encoded
    anew: the plain encoding must fit only where a setting change may drop the cache and send it (checking it always
    jammed a chat near its context, every later message refused)."""
    import importlib
    g = importlib.import_module("localllm.generate")
    limit = lm.model.cfg.max_position_embeddings
    prompt = "one two " * limit  # past the context encoded anew
    monkeypatch.setattr(g, "_splice", lambda tok, p, ids, cached: ids if cached is None else ids[:8])  # (cache)
    assert g.generate(lm, prompt, max_new_tokens=2, temperature=0, reuse_cache=True) is not None
    with pytest.raises(LocalLLMError, match="this model's context is"):
        g.generate(lm, prompt, max_new_tokens=2, temperature=0, reuse_cache=True, qdec="off")
