"""KV transfer between workers for disaggregated prefill/decode (docs/disagg.md).

`source` serves a prefill worker's pinned blocks and frees them on pickup or timeout;
`receiver` pulls what a decode worker lacks and stages it for the engine; `transport` holds
the backends that move the bytes; `blocks` cuts and joins block payloads; `metrics` counts.
"""
