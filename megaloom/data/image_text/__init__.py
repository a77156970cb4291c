"""Image-text data for multimodal models (llava): records from local files or a generated synthetic set, their
text tokenized with <image> placeholders expanded and prompt/image tokens masked from the loss, packed into
rows of train.seq_len + 1 tokens with up to data.max_images images, decoded in the loader's worker processes.

    sources.py    records: a folder of *.jsonl + images, WebDataset-style *.tar shards, or the synthetic set
    synthetic.py  the synthetic set: shapes and colours drawn with PIL, captions made from the same choices
    images.py     decode, crop to square, resize, normalise (PIL + numpy)
    tokens.py     the tokenizer (with <image>) and a record's tokens and loss mask
    packed.py     the packing plan (prefix-stable, from the seed) and the dataset of rows
    batch.py      `ImageTextBatch`: a batch of rows; the training step takes its inputs, labels and images
    build.py      data.* -> (train, valid, tokenizer), as `data.dataset.build_datasets` for text
"""
