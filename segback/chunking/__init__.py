"""The conversation-chunking experiment: data, prompt, filter, generation and scoring.

A model reads a long chat and answers `{"chunks": [{"anchor": <message id>, "label": <title>}]}`,
one entry per topical chunk. `dataset` stitches ShareGPT conversations into multi-topic chats
(gold chunks = the stitched sources), `prompt` renders a case, `filter` keeps cases that fit a
token budget, `generate` runs a model greedily and `scorer` grades the answers: `extract` pulls
their JSON out, `placement` puts their chunks in the transcript, `metrics` measures the
segmentation and `inputs` reads the gold cases and predictions.

Rows of a raw split hold the chat under `messages`; rows written by `filter-data` hold it under
`transcript` and use `messages` for the trainable [user prompt, assistant gold] pair.
"""
