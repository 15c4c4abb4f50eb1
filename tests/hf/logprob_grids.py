"""What the linear-attention hybrids' HF tests share (tests/hf/test_qwen3_next.py, tests/hf/test_kimi_linear.py):
the inputs drawn from transformers' model (a prompt and its greedy continuation; two packed documents), transformers'
log-probabilities of each document alone, cp_ext's log-probabilities of the imported checkpoint at a grid (one
training-layout forward, the worker's), one launch per world size, and the comparison.

These models are scored by a forward, not by tools/generate.py, so that every position of every grid is compared
(transformers' packed path is not a reference: it drops ``cu_seq_lens``, so the packed case is compared per document).
"""

import json
import os
from pathlib import Path

from tests.launch import launch, worker_args, write_results

CASES = ("one_document", "two_documents")


def draw_inputs(model, length, new_tokens, documents, seed=7):
    """({case: token ids}, {case: transformers' log-probs [s, vocab]}): a prompt of ``length - new_tokens`` random
    tokens and the ``new_tokens`` transformers' ``generate`` picks greedily after it; random documents of the
    lengths ``documents``, each scored alone."""
    import torch

    draw = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (1, length - new_tokens), generator=draw)
    with torch.no_grad():
        ids = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)[0]
    docs = [torch.randint(0, model.config.vocab_size, (n,), generator=draw) for n in documents]
    ids = {"one_document": ids.tolist(), "two_documents": [d.tolist() for d in docs]}
    reference = {"one_document": transformers_logprobs(model, ids["one_document"]),
                 "two_documents": torch.cat([transformers_logprobs(model, d) for d in ids["two_documents"]])}
    return ids, reference


def transformers_logprobs(model, ids):
    """transformers' log-probabilities [s, vocab] of the fp32 logits of one document."""
    import torch

    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor(ids)[None]).logits.float()[0], dim=-1)


def score(model, tokens, position_ids, document_ids):
    """Log-probabilities [s, vocab] of the next token at every position of the full sequence ``tokens``, the model
    run on this rank's shard in the training layout; the same on every rank."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from cp_ext import parallel_state as cp_state

    s = tokens.numel()
    positions = cp_state.get_context_parallel_positions(s, model.config.cp_layout)
    documents = None if document_ids is None else document_ids[positions][None]
    with torch.no_grad():
        logits = model(tokens[positions][None], position_ids[positions][None], documents)[0]  # [s_local, vocab / TP]
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits.contiguous())
    full = torch.zeros(s, logits.shape[-1])
    full[positions] = torch.log_softmax(logits.float(), dim=-1)
    if parallel_state.get_context_parallel_world_size() > 1:  # each position on one CP rank, zeros elsewhere
        dist.all_reduce(full, group=parallel_state.get_context_parallel_group())
    return full


def run_worker(argv, grids, flags, *, per_document_positions, generate=0):
    """The worker: for every grid asked (``--grids``) and model (``--inputs``), the checkpoint loaded with
    ``flags`` and the grid's, and both cases scored; rank 0 saves them. ``per_document_positions``: each packed
    document's positions restart at 0 (for models whose RoPE reads them: ``--reset-position-ids``). ``generate``:
    also generate that many tokens greedily after the one document's prompt (`cp_ext.inference.Generator`, its
    CP-sharded cache), with their log-probs and the prompt's ("generated": {"ids", "prompt_logprobs",
    "logprobs"})."""
    import torch
    import torch.distributed as dist

    from cp_ext.arguments import parse_args
    from cp_ext.inference import Generator
    from cp_ext.training.model_from_flags import model_from_flags

    opts = worker_args(argv, required=["--grids", "--inputs"])
    inputs = json.loads(Path(opts.inputs).read_text())
    results = {"results_dir": opts.results_dir}
    for grid in opts.grids.split(","):
        for family, given in inputs.items():
            ckpt = Path(given["ckpt"])
            args = parse_args(["--config", str(ckpt / "model.yaml"), "--load", str(ckpt), "--finetune", *flags,
                               *grids[grid][1]])
            stack, _ = model_from_flags(args)
            model = stack.chunks[0].eval()
            one = torch.tensor(given["one_document"])
            docs = [torch.tensor(d) for d in given["two_documents"]]
            packed = torch.cat(docs)
            positions = (torch.cat([torch.arange(d.numel()) for d in docs]) if per_document_positions
                         else torch.arange(packed.numel()))
            scores = {"one_document": score(model, one, torch.arange(one.numel()), None),
                      "two_documents": score(model, packed, positions,
                                             torch.cat([torch.full_like(d, i) for i, d in enumerate(docs)]))}
            if generate:
                out = Generator(model).generate(one[:-generate].tolist(), generate, logprobs=True)
                scores["generated"] = {"ids": out.new_ids, "prompt_logprobs": out.prompt_logprobs,
                                       "logprobs": out.new_logprobs}
            if int(os.environ["RANK"]) == 0:
                path = Path(opts.results_dir, f"{grid}_{family}.pt")
                torch.save(scores, path)
                results[f"{grid}/{family}"] = str(path)
            del stack, model
    write_results(opts.results_dir, results)
    dist.barrier()
    dist.destroy_process_group()


def scores_getter(script, grids, converted, inputs_path, quick):
    """``get(grid, family)``: cp_ext's {case: log-probs [s, vocab]}; one launch per world size of ``script``'s
    worker, every grid of that size in it (under ``-m quick`` the one grid asked for)."""
    import torch

    inputs_path.write_text(json.dumps({f: dict(ckpt=str(c[1]), **c[3]) for f, c in converted.items()}))
    done = {}

    def get(grid, family):
        if grid not in done:
            world = grids[grid][0]
            wanted = [grid] if quick else [g for g, (size, _) in grids.items() if size == world]
            results = launch(script, world, "--grids", ",".join(wanted), "--inputs", inputs_path, timeout=1200)[0]
            done.update(dict.fromkeys(wanted, results))
        return torch.load(done[grid][f"{grid}/{family}"])

    return get


def check_logprobs(ours, reference, ids, new_tokens, tolerance=1e-4):
    """Every position's log-probs within ``tolerance`` of transformers' in both cases, and transformers' greedy
    tokens cp_ext's argmax after the prompt."""
    for case in CASES:  # ("generated": check_generation's)
        assert ours[case].shape == reference[case].shape, case
        error = (ours[case] - reference[case]).abs().max()
        assert error <= tolerance, (case, error)
    one = ids["one_document"]
    prompt = len(one) - new_tokens
    assert ours["one_document"][prompt - 1:-1].argmax(-1).tolist() == one[prompt:]


def check_generation(ours, reference, ids, new_tokens, tolerance=1e-4):
    """cp_ext's generation after the one document's prompt gives transformers' greedy tokens, and each prompt
    token's and generated token's log-prob within ``tolerance`` of transformers' log_softmax."""
    import torch

    one = ids["one_document"]
    prompt = len(one) - new_tokens
    generated = ours["generated"]
    assert generated["ids"] == one[prompt:]
    ours_logprobs = generated["prompt_logprobs"][1:] + generated["logprobs"]
    theirs = reference["one_document"][:-1].gather(1, torch.tensor(one[1:])[:, None])[:, 0].tolist()
    assert len(ours_logprobs) == len(theirs) == len(one) - 1
    worst = max(abs(a - b) for a, b in zip(ours_logprobs, theirs))
    assert worst <= tolerance, worst


def check_export_bit_for_bit(tool, hf, ckpt, out, shard_size):
    """``tool export`` of ``ckpt`` into ``out`` in shards of ``shard_size`` gives every tensor of the HF dir ``hf``
    back: the same names, dtypes and bits, in several shards with an index that transformers' from_pretrained loads
    with no missing or unexpected key. Returns the original tensors {name: tensor}."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.launch import run_script

    proc = run_script(0, tool, "export", "--load", ckpt, "--hf-dir", out, "--max-shard-size", shard_size)
    assert "shard(s)" in proc.stdout
    original, exported = {}, {}
    for path in hf.glob("*.safetensors"):
        original.update(load_file(path))
    for path in out.glob("*.safetensors"):
        exported.update(load_file(path))
    assert sorted(exported) == sorted(original)
    differ = [k for k in original if not (torch.equal(exported[k], original[k]) and exported[k].dtype == original[k].dtype)]
    assert not differ, [(k, original[k].dtype, exported[k].dtype) for k in differ[:5]]
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").exists()
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    return original
