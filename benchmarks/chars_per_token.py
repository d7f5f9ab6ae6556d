"""Benchmark: characters per token of Direct Forecast prompts, tokenized by the embedded model's tokenizer.

For each `--chars-per-token` value, renders the Direct Forecast prompt of every trajectory of a
warehouse's cohort as `tasks/direct.py` does (history with code titles; `--no-titles` leaves them out),
formats it with the gemma chat template as the embedded server does, and counts its tokens with the
packaged GGUF's tokenizer (loaded alone: `vocab_only`). Prints how many prompts exceed the tokens the
window leaves for them (`context_window - max_output_tokens`) and the spread of characters per token;
the default `llm.chars_per_token` is chosen from it (docs/llm.md, *Prompt budget*). Writes JSON to
benchmarks/results/chars_per_token.json.

    python benchmarks/chars_per_token.py --data-dir data [--cohort default] [--no-titles] [--model M] 3.0 2.7
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO))

from benchmarks.provenance import write_result  # noqa: E402
from models.llm.config import LLMConfig  # noqa: E402
from models.llm.local_server import fold_system_messages, packaged_model_path  # noqa: E402
from tasks.direct import direct_prompt  # noqa: E402
from warehouse.cohorts import code_titles, get_cohort  # noqa: E402
from warehouse.store import Warehouse  # noqa: E402
from warehouse.vocab import Vocabulary  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("values", nargs="*", type=float, default=[LLMConfig().chars_per_token],
                        help="chars_per_token values to budget with (default: the configured default)")
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--cohort", default="default")
    parser.add_argument("--no-titles", action="store_true", help="render codes without their titles")
    parser.add_argument("--model", type=Path, default=None,
                        help="GGUF whose tokenizer counts (default: the packaged model under <data-dir>/models)")
    args = parser.parse_args()

    import llama_cpp
    from llama_cpp.llama_chat_format import format_gemma

    model = args.model or packaged_model_path(args.data_dir / "models")
    tokenizer = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    wh = Warehouse(args.data_dir)
    cohort_id = get_cohort(wh, args.cohort)["cohort_id"]
    vocabulary = Vocabulary.from_warehouse(wh.connect(tables=["cohorts", "cohort_vocabulary"]), cohort_id)
    if args.no_titles:
        vocabulary.title = lambda code: None
    titles = {} if args.no_titles else code_titles(wh, cohort_id)
    records = list(wh.read("pretarget_events", cohort_id=cohort_id).partition_by("trajectory_id"))

    def tokens(messages: list[dict]) -> int:
        prompt = format_gemma(messages=fold_system_messages(messages)).prompt
        return len(tokenizer.tokenize(prompt.encode(), add_bos=True, special=True))

    print(f"{len(records)} trajectories of cohort {args.cohort} ({cohort_id}), titles {not args.no_titles}")
    print("| chars/token budgeted | truncated | over the window's budget | longest prompt (tokens) "
          "| measured chars/token: min, 1st pct, median | densest truncated prompt |")
    print("|---|---|---|---|---|---|")
    rows = []
    for value in args.values:
        config = LLMConfig(chars_per_token=value)
        room = config.context_window - config.max_output_tokens
        ratios, cut, counts = [], [], []
        for events in records:
            rendered = direct_prompt(events, vocabulary, config, code_titles=titles)
            count = tokens(rendered.messages)
            ratio = sum(len(m["content"]) for m in rendered.messages) / count
            counts.append(count)
            ratios.append(ratio)
            if rendered.truncated_chars:
                cut.append(ratio)
        ratios.sort()
        over = sum(count > room for count in counts)
        densest_cut = f"{min(cut):.2f}" if cut else "-"
        print(f"| {value} | {len(cut)} | {over} of {len(records)} (budget {room}) | {max(counts)} "
              f"| {ratios[0]:.2f}, {ratios[len(ratios) // 100]:.2f}, {statistics.median(ratios):.2f} "
              f"| {densest_cut} |")
        rows.append({"chars_per_token": value, "truncated": len(cut), "over_budget": over, "budget_tokens": room,
                     "longest_prompt_tokens": max(counts), "min_chars_per_token": ratios[0],
                     "p1_chars_per_token": ratios[len(ratios) // 100], "median_chars_per_token":
                     statistics.median(ratios), "densest_truncated": min(cut) if cut else None})
    result = {"cohort_id": cohort_id, "trajectories": len(records), "titles": not args.no_titles,
              "model": str(model), "rows": rows}
    write_result(RESULTS / "chars_per_token.json", result)


if __name__ == "__main__":
    main()
