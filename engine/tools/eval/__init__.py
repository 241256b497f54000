"""``ninfer-eval`` (``python -m engine.tools.eval``): the checks to run before trusting a configuration.

    cli.py       the command: subcommands, engine settings (as ninfer-serve takes them) or --url, the results file
    target.py    what is evaluated: the in-process engine built from settings (logits of every position captured),
                 or any OpenAI-compatible server (target.RemoteTarget)
    results.py   the resumable JSONL results file: one line per finished item, skipped when a run resumes
    kld.py       KL divergence, top-1 agreement and perplexity against a reference configuration
    kld_url.py   kld --url: a lower bound of the KLD from a server's top-k logprobs
    llamacpp.py  kld --llama-cpp: llama.cpp (llama-cpp-python, when installed) as the candidate
    needle.py    pass-key needles over a grid of context lengths x depths, several seeds each
    count.py     counting a word spread over the whole prompt
    heatmap.py   the needle grid as a PNG (standard library only)
    code.py      small programming problems (HumanEval format) run with their tests in the sandbox
    sandbox.py   runs an untrusted program under limits and says how it ended
    agent.py     tasks through the chat tools API (tool calls, JSON, logs, a multi-turn code fix)
    stats.py     confidence intervals of pass rates
    compare.py   compare A B: chosen checks on two configurations in one report (Markdown, JSON, PNG)

Imports run one way: cli.py imports the checks, which import target.py, results.py and heatmap.py (or nothing of
this package).
See docs/EVAL.md."""
