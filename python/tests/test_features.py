"""Feature requests against pyfarmhash (the reference implementation of
FarmHash Fingerprint64, what TensorFlow's to_hash_bucket_fast uses)."""

import random

import farmhash
import numpy as np

import hkvd

NB = 2**64 - 4  # the largest bucket count: keys are the fingerprints themselves (mod 2^64 - 4)


def test_hash_equals_pyfarmhash_for_every_length_and_int64_edge(daemon):
    rng = random.Random(5)
    strings = [bytes(rng.randrange(256) for _ in range(n)) for n in range(0, 301)]
    with hkvd.Client(daemon.socket) as c:
        keys = c.hash(strings, num_buckets=NB)
        assert keys.dtype == np.uint64
        assert [int(k) for k in keys] == [farmhash.fingerprint64(s) % NB for s in strings]
        ints = [0, -1, 1, 2**63 - 1, -2**63] + [s * 10**k for k in range(19) for s in (1, -1)]
        keys = c.hash(np.array(ints, dtype=np.int64), num_buckets=1_000_000)
        assert [int(k) for k in keys] == [farmhash.fingerprint64(str(x)) % 1_000_000 for x in ints]
        # TensorFlow's own vectors, and the Arrow-style (bytes, offsets) form.
        tf = [12917804110809363939, 11795596070477164822, 11430444447143000872, 4470636696479570465]
        assert [int(k) for k in c.hash((b"abcd", [0, 1, 2, 3, 4]), num_buckets=NB)] == [t % NB for t in tf]


def test_hash_without_buckets_or_table_names_both(daemon):
    # A tester's finding: c.hash(["a"]) said only "the table's hash was asked
    # for, but no table was named", not the arguments that give one.
    with hkvd.Client(daemon.socket) as c:
        try:
            c.hash(["a"])
            raise AssertionError("a hash without num_buckets or table was sent")
        except ValueError as e:
            assert "num_buckets=" in str(e) and "table=" in str(e), e


def test_fused_requests_use_the_tables_hash(daemon):
    with hkvd.Client(daemon.socket) as c:
        c.create_table("feat", dim=3, capacity=1 << 12, num_buckets=2**40)
        users = [f"user-{i}" for i in range(300)]
        rows = np.arange(900, dtype=np.float32).reshape(300, 3)
        got = c.find_or_insert_features("feat", users, rows)
        assert np.array_equal(got, rows)
        keys = np.array([farmhash.fingerprint64(u) % 2**40 for u in users], dtype=np.uint64)
        values, found = c.find("feat", keys)
        assert found.all() and np.array_equal(values, rows)
        values, found = c.find_features("feat", users + ["nobody"])
        assert found[:300].all() and not found[300]
        assert np.array_equal(values[:300], rows)
        try:
            c.find_features("feat", (b"abc", [0, 2, 1]))
            raise AssertionError("decreasing offsets were accepted")
        except hkvd.HkvdError as e:
            assert "decrease" in str(e)
