from __future__ import annotations

from services.bench.sse import SseDecoder


def test_events_split_anywhere_and_joined():
    stream = b'data: {"a": 1}\n\n: comment\nevent: x\ndata: one\ndata: two\n\ndata: [DONE]\n\n'
    for cut in range(len(stream)):
        decoder = SseDecoder()
        events = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:]) + decoder.close()
        assert events == ['{"a": 1}', "one\ntwo", "[DONE]"], cut


def test_crlf_cr_and_utf8_split():
    data = "data: héllo\r\n\r\ndata:x\r\rdata: last".encode()
    decoder = SseDecoder()
    events = [e for i in range(len(data)) for e in decoder.feed(data[i:i + 1])]
    assert events == ["héllo", "x"]
    assert decoder.close() == ["last"]  # a stream that ends without the blank line
