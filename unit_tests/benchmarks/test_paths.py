"""The shared egress measurements against the sink/source server, in process on loopback."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks import paths


def test_a_dial_spec_names_tcp_or_socks5_and_anything_else_is_refused() -> None:
    assert callable(paths.parse_dial("tcp:bench.ns.svc:9000"))
    assert callable(paths.parse_dial("socks5:proxy.ns.svc:1080:198.18.5.2:9000"))
    for bad in ("tcp:host", "udp:host:1", "socks5:proxy:1080:host"):
        with pytest.raises(ValueError, match="not a dial spec"):
            paths.parse_dial(bad)


async def test_one_round_moves_the_bytes_it_reports() -> None:
    server = await asyncio.start_server(paths.serve_connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        result = await paths.one_round("loopback", paths.tcp_dialer("127.0.0.1", port), mib=1, setups=5)
    assert set(result.samples) == set(paths.COLUMNS)
    assert all(values[0] > 0 for values in result.samples.values())
    assert 0 < result.setup_p50_ms <= result.setup_p99_ms


def test_merging_rounds_keeps_every_sample_and_reports_the_median() -> None:
    total = paths.PathResult("p")
    for value in (3.0, 1.0, 2.0):
        one = paths.PathResult("p")
        one.add("one_stream_up_mbs", value)
        total.merge(one)
    assert total.samples["one_stream_up_mbs"] == [3.0, 1.0, 2.0]
    assert total.one_stream_up_mbs == 2.0
