"""Event-loop CPU that streaming one response's text costs, by output length.

Every streamed token goes through ``TextStream.add`` and ``pending`` on the server's event loop,
which all clients share. With a byte-level tokenizer (Qwen's kind) the stream settles text at
character boundaries and decodes only the tokens after them; any other tokenizer decodes the
whole output again per token. Both are timed on the same tokens (mixed English, CJK and emoji,
one streamed response each, a stop string that never matches), so the ratio is the saving and
the per-token cost's growth with length shows which is linear.

    python benchmarks/detokenize.py [--tokenizer DIR] [--lengths 1000 4000 8000]

Without --tokenizer: the bundled byte tokenizer at Qwen2.5's vocabulary (one token per byte).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.model.tokenizer import byte_tokenizer  # noqa: E402
from engine.serving.detokenize import TextStream, decodes_bytewise, text_decoder  # noqa: E402

TEXT = "Continuous batching admits requests every step; 连续批处理在每一步接纳请求 🙂. "


def stream_cpu_s(tokenizer, ids: list[int], bytewise: bool) -> tuple[float, str]:
    ts = TextStream(text_decoder(tokenizer), stop=("never matches",), bytewise=bytewise)
    out = []
    start = time.process_time()
    for token in ids:
        ts.add(token)
        out.append(ts.pending(final=False))
    out.append(ts.pending(final=True))
    return time.process_time() - start, "".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", help="a checkpoint or tokenizer directory (AutoTokenizer)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 4000, 8000])
    args = parser.parse_args()
    if args.tokenizer:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        tokenizer = byte_tokenizer(151936, eos_token_id=151643)
    print(f"tokenizer: {type(tokenizer).__name__}, byte-level decoder: {decodes_bytewise(tokenizer)}")
    if not decodes_bytewise(tokenizer):
        sys.exit("not a byte-level decoder: the server decodes the whole output per token for it, "
                 "so there is nothing to compare")
    ids_all = tokenizer.encode(TEXT * (max(args.lengths) // 10 + 1))
    print("| output tokens | settled at character boundaries: ms (µs/token) | whole decode per token: ms "
          "(µs/token) | ratio |")
    print("|---|---|---|---|")
    for n in args.lengths:
        ids = ids_all[:n]
        fast_s, fast_text = stream_cpu_s(tokenizer, ids, bytewise=True)
        slow_s, slow_text = stream_cpu_s(tokenizer, ids, bytewise=False)
        assert fast_text == slow_text == tokenizer.decode(ids, skip_special_tokens=True)
        print(f"| {n} | {fast_s * 1e3:.1f} ({fast_s / n * 1e6:.1f}) | {slow_s * 1e3:.1f} ({slow_s / n * 1e6:.1f}) "
              f"| {slow_s / fast_s:.0f}× |")


if __name__ == "__main__":
    main()
