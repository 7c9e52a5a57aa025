"""lm-evaluation-harness (the pinned dev dependency) end to end against a real `rlt serve`
(issue 25's acceptance): its `local-completions` model runs a multiple-choice task
(loglikelihood), a perplexity task (loglikelihood_rolling) and a generation task
(generate_until) from task YAMLs and JSONL data written here, offline, with the checkpoint's own
tokenizer; every loglikelihood it reports equals rlt's own scoring of the same text (the
server's echo + logprobs on the text, continuation tokens picked by their text offsets), its
is_greedy flags and accuracy follow from those scores, and its generations equal the server's
greedy completion of the same prompt.

Its `local-chat-completions` model (chat messages to /v1/chat/completions, no tokenizer on the
harness's side) runs the generation task with `apply_chat_template`: each generation equals the
server's greedy chat completion of the messages the harness sent, also with rlt's loop fields
passed as generation kwargs; a loglikelihood task is refused by the harness itself (0.4.13's
chat model has no loglikelihood), before any request.

Exit-depth scoring goes through `rlt-completions` (benchmarks/rlt_lm_eval.py, the script
docs/evaluation.md runs), which adds rlt's loop fields (`exit_threshold`, `min_loops`) to every
request and `score_at_exit_depth: true` to the loglikelihood ones; its loglikelihoods equal the
server's exit-depth scoring of the same texts, and differ from the full-depth ones.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from serving_harness import run_server

pytestmark = [
    pytest.mark.slow,
    # the harness's AutoTokenizer reads the checkpoint's config.json (rope fields of `ouro`)
    pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning"),
]

MC_DOCS = [
    {"question": "Which city is the capital of France?", "choices": ["Rome", "Paris"], "answer": 1},
    {"question": "What colour is the sky?", "choices": ["blue", "green", "loud"], "answer": 0},
    {"question": "How many legs has a cat?", "choices": ["two", "seven", "four"], "answer": 2},
]
PPL_DOCS = [
    {"text": "It is a truth universally acknowledged that a story needs a beginning."},
    {"text": "The old house at the end of the lane was quiet, and the garden was full of rain."},
]
GEN_DOCS = [
    {"prompt": "Q: What is the colour of grass?\nA:", "target": " green"},
    {"prompt": "Once upon a time there was", "target": " a king"},
]
MAX_GEN_TOKS = 6
UNTIL = ["\n"]
TASKS = ["rlt_mc", "rlt_ppl", "rlt_gen"]
EXIT_RULE = {"exit_threshold": 0.5, "min_loops": 1}  # depths vary on this checkpoint


def write_tasks(root) -> None:
    """Three task YAMLs (JSON is YAML) over JSONL files, all under `root`."""
    cache = str(root / "datasets_cache")

    def task(name: str, docs: list[dict], **config) -> None:
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        body = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": cache},
            "test_split": "test",
            "metadata": {"version": 1.0},
            **config,
        }
        (root / f"{name}.yaml").write_text(json.dumps(body, indent=2) + "\n")

    task(
        "rlt_mc",
        MC_DOCS,
        output_type="multiple_choice",
        doc_to_text="Question: {{question}}\nAnswer:",
        doc_to_choice="{{choices}}",
        doc_to_target="{{answer}}",
        metric_list=[{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    )
    task(
        "rlt_ppl",
        PPL_DOCS,
        output_type="loglikelihood_rolling",
        doc_to_text="",
        doc_to_target="{{text}}",
        metric_list=[
            {"metric": m, "aggregation": "weighted_perplexity", "higher_is_better": False}
            for m in ("word_perplexity", "byte_perplexity")
        ],
    )
    task(
        "rlt_gen",
        GEN_DOCS,
        output_type="generate_until",
        doc_to_text="{{prompt}}",
        doc_to_target="{{target}}",
        generation_kwargs={"until": UNTIL, "max_gen_toks": MAX_GEN_TOKS, "do_sample": False},
        metric_list=[{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    )


def rlt_completions_model():
    """Registers `rlt-completions` (benchmarks/rlt_lm_eval.py, the script docs/evaluation.md
    runs) by importing it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import rlt_lm_eval  # noqa: F401


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """lm_eval imported offline (HF_DATASETS_OFFLINE, HF_HUB_OFFLINE), its task manager over
    the task files written here alone (no bundled task is indexed)."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            patch.setenv(name, "1")
        patch.setenv("NO_PROXY", "127.0.0.1,localhost")  # the harness posts with `requests`
        patch.setenv("no_proxy", "127.0.0.1,localhost")
        import lm_eval
        from lm_eval.tasks import TaskManager

        rlt_completions_model()
        root = tmp_path_factory.mktemp("lm_eval_tasks")
        write_tasks(root)
        manager = TaskManager(include_path=str(root), include_defaults=False)
        yield lm_eval, manager


@pytest.fixture(scope="module")
def server(checkpoint):
    with run_server(checkpoint, served_model_name="tiny") as running:
        yield running


def evaluate(harness, server, checkpoint, model: str, **extra_args) -> dict:
    lm_eval, manager = harness
    model_args = {
        "model": "tiny",
        "base_url": f"{server.base_url}/v1/completions",
        "tokenizer": str(checkpoint),
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,
        "max_length": 512,  # the checkpoint's max_position_embeddings
        "max_retries": 1,
        "timeout": 60,
        **extra_args,
    }
    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=TASKS,
        task_manager=manager,
        log_samples=True,
        bootstrap_iters=0,
    )
    assert set(results["samples"]) == set(TASKS)
    return results


def samples(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda sample: sample["doc_id"])


def score(http, text: str, **fields) -> dict:
    """rlt's own scoring of `text`: the choice's logprobs of echo + logprobs, no generation."""
    body = {"prompt": text, "echo": True, "logprobs": 1, "max_tokens": 0, **fields}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def continuation_score(http, context: str, continuation: str, **fields) -> tuple[float, bool]:
    """Log-probability of `continuation` after `context` by rlt, and whether each of its tokens
    is the most likely one (lm-eval's (loglikelihood, is_greedy) pair)."""
    logprobs = score(http, context + continuation, **fields)["logprobs"]
    offsets = logprobs["text_offset"]
    start = offsets.index(len(context))  # a token boundary where the continuation starts
    scores = logprobs["token_logprobs"][start:]
    tops = logprobs["top_logprobs"][start:]
    assert scores and None not in scores
    return sum(scores), all(s == max(top.values()) for s, top in zip(scores, tops, strict=True))


def rolling_score(http, server, text: str, **fields) -> float:
    """Log-probability of the whole `text` by rlt, its first token conditioned on the
    tokenizer's BOS (`<|endoftext|>`), as lm-eval's rolling windows condition it."""
    tokenizer = server.engine.tokenizer
    bos = tokenizer.bos_token or tokenizer.eos_token
    tokens = http.post("/tokenize", json={"prompt": bos + text}).json()["tokens"]
    assert tokens[0] == tokenizer.convert_tokens_to_ids(bos)
    assert len(tokens) < 512  # one window
    scores = score(http, bos + text, **fields)["logprobs"]["token_logprobs"]
    assert scores[0] is None and len(scores) == len(tokens)
    return sum(scores[1:])


def greedy_completion(http, prompt: str, **fields) -> str:
    body = {
        "prompt": prompt,
        "max_tokens": MAX_GEN_TOKS,
        "temperature": 0,
        "stop": [*UNTIL, "<|endoftext|>"],  # lm-eval adds the EOS string to `until`
        **fields,
    }
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def check_against_rlt(results: dict, http, server, *, at_exit_depth: bool, **loops) -> dict:
    """Every request's result in `results` equals rlt's scoring (at full or exit depth) or
    completion of the same text under the loop fields `loops`; returns the loglikelihoods by
    (task, doc, request)."""
    fields = {**loops, "score_at_exit_depth": True} if at_exit_depth else loops
    lls = {}
    correct = []
    for sample in samples(results, "rlt_mc"):
        doc = MC_DOCS[sample["doc_id"]]
        assert len(sample["arguments"]) == len(doc["choices"])
        choice_lls = []
        for index, (arguments, resps) in enumerate(
            zip(sample["arguments"], sample["resps"], strict=True)
        ):
            context, continuation = arguments
            assert context == f"Question: {doc['question']}\nAnswer:"
            assert continuation == " " + doc["choices"][index]
            loglikelihood, is_greedy = resps[0]
            want = continuation_score(http, context, continuation, **fields)
            assert (loglikelihood, bool(is_greedy)) == want
            choice_lls.append(loglikelihood)
            lls["rlt_mc", sample["doc_id"], index] = loglikelihood
        correct.append(max(range(len(choice_lls)), key=choice_lls.__getitem__) == doc["answer"])
    assert results["results"]["rlt_mc"]["acc,none"] == sum(correct) / len(correct)

    total, words = 0.0, 0
    for sample in samples(results, "rlt_ppl"):
        text = PPL_DOCS[sample["doc_id"]]["text"]
        assert sample["arguments"][0][0] == text
        (loglikelihood,) = sample["resps"][0]
        assert loglikelihood == rolling_score(http, server, text, **fields)
        lls["rlt_ppl", sample["doc_id"], 0] = loglikelihood
        total, words = total + loglikelihood, words + len(text.split())
    perplexity = results["results"]["rlt_ppl"]["word_perplexity,none"]
    assert perplexity == pytest.approx(math.exp(-total / words), rel=1e-12)

    for sample in samples(results, "rlt_gen"):
        prompt = GEN_DOCS[sample["doc_id"]]["prompt"]
        assert sample["arguments"][0][0] == prompt
        (generated,) = sample["resps"][0]
        assert generated == greedy_completion(http, prompt, **loops)
    return lls


def test_local_completions_scores_equal_rlts_own(harness, server, checkpoint, http):
    results = evaluate(harness, server, checkpoint, "local-completions")
    check_against_rlt(results, http, server, at_exit_depth=False)
    server.wait_idle()


def test_exit_depth_scores_through_a_subclass_equal_rlts_own(harness, server, checkpoint, http):
    exit_depth = evaluate(harness, server, checkpoint, "rlt-completions", **EXIT_RULE)
    lls = check_against_rlt(exit_depth, http, server, at_exit_depth=True, **EXIT_RULE)
    # the rule really stops positions before the last loop, and that changes the scores
    loops = json.loads((checkpoint / "config.json").read_text())["total_ut_steps"]
    depths = score(http, PPL_DOCS[1]["text"], score_at_exit_depth=True, **EXIT_RULE)
    assert min(depths["prompt_exit_depths"][1:]) < loops
    full_depth = {}
    for task, doc_id, index in lls:
        if task == "rlt_mc":
            doc = MC_DOCS[doc_id]
            context = f"Question: {doc['question']}\nAnswer:"
            full = continuation_score(http, context, " " + doc["choices"][index])[0]
        else:
            full = rolling_score(http, server, PPL_DOCS[doc_id]["text"])
        full_depth[task, doc_id, index] = full
    assert any(lls[key] != full_depth[key] for key in lls)
    server.wait_idle()


def chat_completion(http, messages: list[dict], **fields) -> str:
    """The server's greedy chat completion, with the fields local-chat-completions sends."""
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": MAX_GEN_TOKS,
        "temperature": 0,
        "stop": UNTIL,  # no tokenizer on the harness's side: no EOS string added
        "seed": 1234,
        **fields,
    }
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_local_chat_completions_generates_as_rlts_chat(harness, server, http):
    """local-chat-completions on the generation task (with the chat template applied by the
    server), at full depth and with loop fields as generation kwargs; a loglikelihood task is
    not supported by the harness's chat model."""
    lm_eval, manager = harness
    model_args = {
        "model": "tiny",
        "base_url": f"{server.base_url}/v1/chat/completions",
        "max_retries": 1,
        "timeout": 60,
    }
    for loops in ({}, EXIT_RULE):
        results = lm_eval.simple_evaluate(
            model="local-chat-completions",
            model_args=model_args,
            tasks=["rlt_gen"],
            task_manager=manager,
            apply_chat_template=True,
            gen_kwargs=",".join(f"{k}={v}" for k, v in loops.items()) or None,
            log_samples=True,
            bootstrap_iters=0,
        )
        for sample in samples(results, "rlt_gen"):
            arguments = sample["arguments"][0]
            messages = json.loads(arguments[0].prompt)  # a JsonChatStr
            assert messages == [{"role": "user", "content": GEN_DOCS[sample["doc_id"]]["prompt"]}]
            assert {k: arguments[1][k] for k in loops} == loops  # the loop fields went along
            (generated,) = sample["resps"][0]
            assert generated == chat_completion(http, messages, **loops)
    with pytest.raises(NotImplementedError, match="chat completions"):
        lm_eval.simple_evaluate(
            model="local-chat-completions",
            model_args=model_args,
            tasks=["rlt_mc"],
            task_manager=manager,
            apply_chat_template=True,
            bootstrap_iters=0,
        )
    server.wait_idle()
