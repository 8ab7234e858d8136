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


def _refused(call, error, culprit):
    """``call()`` raises ``error`` before sending anything, and its message
    names ``culprit`` (the argument, with its index)."""
    try:
        call()
    except error as e:
        assert culprit in str(e), e
        return
    raise AssertionError(f"accepted; expected {error.__name__} naming {culprit}")


def test_offsets_outside_u32_are_refused_not_wrapped(daemon):
    # A tester's finding: offsets were cast to u32, so (b"abcde", [0, 2**32 + 3])
    # was hashed as "abc", np.array([0, 2**33]) as "", and [-1, 2] was refused by
    # the daemon naming the wrapped 4294967295. Now the client refuses them,
    # naming the offset as given.
    with hkvd.Client(daemon.socket) as c:
        _refused(lambda: c.hash((b"abcde", [0, 2**32 + 3]), num_buckets=NB), ValueError, str(2**32 + 3))
        _refused(lambda: c.hash((b"abcde", np.array([0, 2**33])), num_buckets=NB), ValueError, str(2**33))
        _refused(lambda: c.hash((b"abcde", [-1, 2]), num_buckets=NB), ValueError, "offsets[0] = -1")
        _refused(lambda: c.hash((b"abcde", np.array([0, -2], np.int8)), num_buckets=NB), ValueError, "offsets[1] = -2")
        _refused(lambda: c.hash((b"abcde", np.array([0.0, 2.0])), num_buckets=NB), TypeError, "offsets")
        _refused(lambda: c.hash((b"abcde", [0, True]), num_buckets=NB), TypeError, "offsets[1]")
        # Offsets within range still mean what PROTOCOL.md says, whatever their integer type.
        for offsets in ([0, 3, 5], np.array([0, 3, 5], np.uint64), np.array([0, 3, 5], np.int16)):
            keys = c.hash((b"abcde", offsets), num_buckets=NB)
            assert [int(k) for k in keys] == [farmhash.fingerprint64(s) % NB for s in ("abc", "de")]


def test_a_non_string_in_a_list_of_strings_is_refused_naming_its_index(daemon):
    # A tester's finding: bytes(3) is three NUL bytes, so ["a", 3] hashed
    # element 1 as "\0\0\0", 10**6 as a 1 MB zero string, and 10**10 raised
    # struct's "'I' format requires ...". docs/python.md documents no int
    # inside a list of strings.
    with hkvd.Client(daemon.socket) as c:
        for bad in (3, 10**6, 10**10, 1.5, None, [1]):
            _refused(lambda: c.hash(["a", bad], num_buckets=NB), TypeError, "features[1]")
            _refused(lambda: c.find_features("t", ["a", "b", bad], num_buckets=NB), TypeError, "features[2]")
        _refused(lambda: c.hash([1, "a"], num_buckets=NB), TypeError, "features[1]")


def test_values_without_an_int64_decimal_text_are_refused_not_converted(daemon):
    # A tester's finding: np.array([1.5]) was truncated and hashed as "1",
    # 2**64 - 1 (a uint64 array or a Python int) as "-1", [True] as "1".
    # PROTOCOL.md: int64 features are hashed as the %lld text of a signed
    # 64-bit integer; what has none is refused.
    with hkvd.Client(daemon.socket) as c:
        _refused(lambda: c.hash(np.array([1.5]), num_buckets=NB), TypeError, "float64")
        _refused(lambda: c.hash(np.array([True]), num_buckets=NB), TypeError, "bool")
        _refused(lambda: c.hash([True], num_buckets=NB), TypeError, "features[0]")
        _refused(lambda: c.hash([1.5], num_buckets=NB), TypeError, "features[0]")
        _refused(lambda: c.hash([1, 2.0], num_buckets=NB), TypeError, "features[1]")
        _refused(lambda: c.hash(np.array([0, 2**64 - 1], np.uint64), num_buckets=NB), ValueError, "features[1]")
        _refused(lambda: c.hash([2**64 - 1], num_buckets=NB), ValueError, "features[0]")
        _refused(lambda: c.hash([-2**63 - 1], num_buckets=NB), ValueError, "features[0]")
        # The int64 range itself, in any integer type, is hashed as its decimal text.
        for ints in ([2**63 - 1, -2**63, 7], np.array([2**63 - 1, 0, 7], np.uint64), np.array([-5, 7], np.int8),
                     [np.int64(-3), np.uint64(2**63 - 1)]):
            keys = c.hash(ints, num_buckets=NB)
            assert [int(k) for k in keys] == [farmhash.fingerprint64(str(int(x))) % NB for x in ints]


def test_bare_strings_numpy_strings_and_a_bad_key_are_handled(daemon):
    # A tester's finding: a bare "abc" was hashed as the three features 'a',
    # 'b', 'c'; np.array(["ab", "c"]) raised "invalid literal for int()";
    # key=(1, 2, 3) raised "too many values to unpack".
    with hkvd.Client(daemon.socket) as c:
        _refused(lambda: c.hash("abc", num_buckets=NB), TypeError, "features")
        _refused(lambda: c.hash(b"abc", num_buckets=NB), TypeError, "features")
        _refused(lambda: c.find_or_insert_features("t", "ab", np.zeros((2, 1), np.float32), num_buckets=NB),
                 TypeError, "features")
        want = [farmhash.fingerprint64(s) % NB for s in ("ab", "c", "é")]
        assert [int(k) for k in c.hash(np.array(["ab", "c", "é"]), num_buckets=NB)] == want
        assert [int(k) for k in c.hash(np.array([b"ab", b"c", "é".encode()]), num_buckets=NB)] == want
        assert [int(k) for k in c.hash(np.array(["ab", "c", "é"], dtype=object), num_buckets=NB)] == want
        _refused(lambda: c.hash(["a"], num_buckets=NB, kind="strong", key=(1, 2, 3)), ValueError, "key")
        _refused(lambda: c.hash(["a"], num_buckets=NB, kind="strong", key=7), TypeError, "key")
