"""Writes a tiny Megatron indexed dataset (``<prefix>_text_document.bin/.idx``) with Megatron's own builder, offline.

Each document is an arithmetic progression of token ids, ``(start + i * step) % vocab``, ending with the
``NullTokenizer``'s end-of-document id (``vocab``): there is something to learn, so the loss falls within a few
steps. Run with Megatron-DeepSpeed's checkout as ``--megatron`` (its ``megatron.data.indexed_dataset`` writes the
files, as its ``tools/preprocess_data.py`` would after tokenizing, without that tool's NLTK import)::

    python examples/megatron/make_data.py --megatron $MEGATRON --out data/tiny --vocab-size 1024

Then ``pretrain_gpt.py --tokenizer-type NullTokenizer --vocab-size 1024 --data-path data/tiny_text_document``.
"""
import argparse
import os
import sys


def documents(vocab_size, count, seed):
    """``count`` documents of 200 to 800 token ids each, in ``[0, vocab_size)``."""
    import numpy as np
    rng = np.random.default_rng(seed)
    for _ in range(count):
        length = int(rng.integers(200, 800))
        start, step = int(rng.integers(0, vocab_size)), int(rng.integers(1, 4))
        yield (start + step * np.arange(length)) % vocab_size


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron", required=True, help="Megatron-DeepSpeed checkout")
    parser.add_argument("--out", required=True, help="output prefix; writes <out>_text_document.bin/.idx")
    parser.add_argument("--vocab-size", type=int, default=1024, help="as pretrain_gpt.py's --vocab-size")
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.abspath(args.megatron))
    import torch
    from megatron.data import indexed_dataset

    prefix = f"{args.out}_text_document"
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    # vocab + 1 ids: the NullTokenizer's end-of-document id is vocab_size
    builder = indexed_dataset.make_builder(indexed_dataset.data_file_path(prefix), impl="mmap",
                                           vocab_size=args.vocab_size + 1)
    tokens = 0
    for doc in documents(args.vocab_size, args.docs, args.seed):
        builder.add_item(torch.tensor([*doc.tolist(), args.vocab_size], dtype=torch.int64))
        builder.end_document()
        tokens += len(doc) + 1
    builder.finalize(indexed_dataset.index_file_path(prefix))
    print(f"wrote {prefix}.bin/.idx: {args.docs} documents, {tokens} tokens, vocab {args.vocab_size} + end-of-document")
    return prefix


if __name__ == "__main__":
    main()
