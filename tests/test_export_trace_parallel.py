"""export-trace's write pass in worker processes: each rank's part is compressed apart and the parts joined into one
gzip member (ledger.present.gzip_join), which must read back as exactly the trace one process writes. The run is
synthetic (tests/fixtures/synthetic_run.py: plumbing)."""
from __future__ import annotations

import gzip
import io
import json
import random
import zlib

import pytest

from ledger.evidence.read import read_run
from ledger.present.gzip_join import Joined, crc32_combine, part_of
from ledger.present.trace_export import export
from tests.fixtures.synthetic_run import Spec, make_run


def test_crc32_combine_is_the_crc_of_the_concatenation():
    rng = random.Random(7)
    for _ in range(100):
        a, b = rng.randbytes(rng.randint(0, 5000)), rng.randbytes(rng.randint(0, 5000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.mark.parametrize("compress", [True, False])
def test_parts_compressed_apart_join_into_one_member(compress):
    texts = [b'{"traceEvents": [', b'{"ph": "X"},' * 5000, b"", b'{"ph": "i"}]}']
    out = io.BytesIO()
    joined = Joined(out, compress)
    for text in texts:
        joined.add(part_of(text, compress))
    joined.close()
    if not compress:
        assert out.getvalue() == b"".join(texts)
        return
    z = zlib.decompressobj(wbits=31)  # one gzip member, nothing after it
    assert z.decompress(out.getvalue()) == b"".join(texts) and z.eof and z.unused_data == b""
    assert gzip.decompress(out.getvalue()) == b"".join(texts)  # its CRC-32 and length check out


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    run, _ = make_run(tmp_path_factory.mktemp("skew") / "run", Spec(skew_us={1: 250.0, 2: -1000.0, 3: 40.0}))
    return run


@pytest.mark.slow
@pytest.mark.parametrize("name", ["merged.json.gz", "merged.json"])
def test_workers_write_what_one_process_writes(skewed, tmp_path, name):
    one = export(read_run(skewed), tmp_path / "one" / name, workers=1)
    two = export(read_run(skewed), tmp_path / "two" / name, workers=2)
    read = (lambda p: json.loads(gzip.decompress(p.read_bytes()))) if name.endswith(".gz") else \
        (lambda p: json.loads(p.read_text()))
    a, b = read(one.out), read(two.out)
    assert a == b and one.events == two.events == len(a["traceEvents"])
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == [name]  # no part left behind
