"""lm-evaluation-harness's ``local-completions`` model against the real server, end to end.

Two local tasks over local data (no dataset hub): a multiple-choice one (loglikelihood
requests: echo, logprobs 1, max_tokens 1 over token-id prompts, lm-eval slicing the prompt's
logprobs back out) and a generate_until one. Run in-process with ``lm_eval.simple_evaluate``
against the session server; its tokenizer is transformers' own of the default model's GGUF.

The loglikelihood task's answers are chosen so the default model gets them right only if the
continuation's logprobs are the right ones: each document's target is the continuation the
server itself scores highest by greedy generation (a plain completions call), so ``acc`` is 1
exactly when lm-eval read the scored continuation tokens at the right positions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import API_KEY, MODEL, Server

QUESTIONS = ["The capital of France is", "One, two, three,", "Monday, Tuesday,",
             "The opposite of hot is", "Water freezes at zero degrees"]


def write_tasks(folder: Path, mc_docs: list[dict[str, Any]], gen_docs: list[dict[str, Any]]) -> None:
    for name, docs in (("mc", mc_docs), ("gen", gen_docs)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))

    def head(name: str) -> str:
        return (f"task: fitserve_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                f"    test: {folder / (name + '.jsonl')}\ntest_split: test\n"
                "doc_to_text: question\ndoc_to_target: answer\ntarget_delimiter: \"\"\n")

    (folder / "fitserve_mc.yaml").write_text(
        head("mc") + "output_type: multiple_choice\ndoc_to_choice: choices\n"
        "metric_list:\n  - metric: acc\n")
    (folder / "fitserve_gen.yaml").write_text(
        head("gen") + "output_type: generate_until\ngeneration_kwargs:\n  until: [\"\\n\"]\n"
        "  max_gen_toks: 2\n  do_sample: false\n  temperature: 0\nmetric_list:\n  - metric: exact_match\n")


def test_local_completions_loglikelihood_and_generate(server: Server, client: Any, smollm2_tokenizer_dir: Path,
                                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    # the same generation lm-eval asks for (max_gen_toks 2, until a newline)
    greedy = [client.completions.create(model=MODEL, prompt=q, max_tokens=2, temperature=0, stop=["\n"])
              .choices[0].text for q in QUESTIONS]
    # the greedy continuation is the answer; the distractors are other documents' continuations
    # (the answer's index varies: equal or constant logprobs would not pick it)
    mc = []
    for i, (q, g) in enumerate(zip(QUESTIONS, greedy, strict=True)):
        choices = [o for o in greedy if o != g][:2]
        choices.insert(i % 3, g)
        mc.append({"question": q, "choices": choices, "answer": i % 3})
    assert all(len(set(d["choices"])) == 3 and all(d["choices"]) for d in mc)  # distinct, non-empty
    gen = [{"question": q, "answer": greedy[i]} for i, q in enumerate(QUESTIONS[:3])]
    write_tasks(tmp_path, mc, gen)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(f"model={MODEL},base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
                    f"tokenizer={smollm2_tokenizer_dir},num_concurrent=1,max_retries=1"),
        tasks=["fitserve_mc", "fitserve_gen"],
        # NOTE: include_defaults=False: indexing lm-eval's own thousands of task files takes ~10 s
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=False)
    assert results is not None
    mc_res, gen_res = results["results"]["fitserve_mc"], results["results"]["fitserve_gen"]
    assert mc_res["acc,none"] == 1.0, mc_res
    assert gen_res["exact_match,none"] == 1.0, gen_res
