//! Where a table's rows live in the cluster, byte by byte (specified for
//! other programs in `proto/PROTOCOL.md`, "Backing tier: key layout").
//!
//! - Meta: `hkv:{T}:meta`, a hash with `layout` (= `1`), `dim` (f32 per
//!   row), `groups` (G) and `row` (what the floats are: `values`, or
//!   `OPTIMIZER over N values`), set once by the first daemon that opens
//!   the table; later openers read G from it, so every host agrees where a
//!   key lives, and are refused when `dim` or `row` differs.
//! - Row of key `k`: `hkv:{T:g}:` followed by `k` as 8 little-endian
//!   bytes, where `g = mix(k) % G` in decimal and `mix` is the SplitMix64
//!   finaliser. The hash tag `{T:g}` puts the whole group in one hash slot,
//!   so one `MGET`/`MSET` serves every key of a batch in that group; G of
//!   16–64 × the masters spreads a table over the cluster in many small
//!   groups (each row its own key, never a giant hash).
//! - Row value: `version u64 | score u64 | dim × f32`, little-endian.
//! - Stream: `hkv:{T}:stream`, one entry per acknowledged write batch.

/// The layout's version, stored in the meta hash.
pub const LAYOUT: u32 = 1;
/// Bytes before a row's values: version and score.
pub const ROW_HEADER: usize = 16;
/// Groups per master when a table is first opened: enough that keys spread
/// evenly over the slots a master owns and over the masters, few enough
/// that a batch of a few thousand keys has dozens of keys per `MGET`.
pub const GROUPS_PER_MASTER: u32 = 32;
/// Redis Cluster's hash slot count.
pub const SLOTS: u16 = 16384;

/// The SplitMix64 finaliser: the group of key `k` is `mix(k) % G`.
pub fn mix(k: u64) -> u64 {
    let mut z = k;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A table's names in the cluster.
#[derive(Debug, Clone)]
pub struct Layout {
    table: String,
    groups: u32,
    dim: usize,
    /// Each group's key prefix `hkv:{T:g}:`.
    prefixes: Vec<Vec<u8>>,
    /// Each group's hash slot.
    slots: Vec<u16>,
}

impl Layout {
    /// The layout of `table` with `groups` groups of rows of `dim` floats.
    pub fn new(table: &str, dim: usize, groups: u32) -> Layout {
        let prefixes: Vec<Vec<u8>> = (0..groups).map(|g| format!("hkv:{{{table}:{g}}}:").into_bytes()).collect();
        let slots = (0..groups).map(|g| slot(format!("{table}:{g}").as_bytes())).collect();
        Layout { table: table.to_string(), groups, dim, prefixes, slots }
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The number of groups.
    pub fn groups(&self) -> u32 {
        self.groups
    }

    /// f32 per row.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Bytes of one row's value in the cluster.
    pub fn row_bytes(&self) -> usize {
        ROW_HEADER + 4 * self.dim
    }

    /// The group of `key`.
    pub fn group(&self, key: u64) -> u32 {
        (mix(key) % u64::from(self.groups)) as u32
    }

    /// The hash slot of group `g`.
    pub fn slot_of_group(&self, g: u32) -> u16 {
        self.slots[g as usize]
    }

    /// The cluster key of `key`'s row.
    pub fn row_key(&self, key: u64) -> Vec<u8> {
        let mut k = Vec::new();
        self.write_row_key(key, &mut k);
        k
    }

    /// Writes the cluster key of `key`'s row into `out` (cleared first):
    /// a batch builds its keys in one buffer.
    pub fn write_row_key(&self, key: u64, out: &mut Vec<u8>) {
        out.clear();
        out.extend_from_slice(&self.prefixes[self.group(key) as usize]);
        out.extend_from_slice(&key.to_le_bytes());
    }

    /// The key whose row `bytes` names, when `bytes` is a row key of this
    /// table (its own prefix for the key's group, then 8 bytes): a walk of
    /// the cluster's keys tells the table's rows from other tables' (a
    /// table `T:x` shares the prefix `hkv:{T:`).
    pub fn parse_row_key(&self, bytes: &[u8]) -> Option<u64> {
        let split = bytes.len().checked_sub(8)?;
        let key = u64::from_le_bytes(bytes[split..].try_into().ok()?);
        (self.prefixes[self.group(key) as usize] == bytes[..split]).then_some(key)
    }

    /// A `SCAN … MATCH` pattern of every row key of the table (and of
    /// tables whose name continues with `:`, which [`Layout::parse_row_key`]
    /// tells apart): `hkv:{T:*`, the glob's special characters of `T`
    /// escaped.
    pub fn scan_pattern(&self) -> Vec<u8> {
        let mut p = b"hkv:{".to_vec();
        for &b in self.table.as_bytes() {
            if matches!(b, b'*' | b'?' | b'[' | b']' | b'\\') {
                p.push(b'\\');
            }
            p.push(b);
        }
        p.extend_from_slice(b":*");
        p
    }

    /// The meta hash's key.
    pub fn meta_key(table: &str) -> String {
        format!("hkv:{{{table}}}:meta")
    }

    /// The stream's key.
    pub fn stream_key(&self) -> String {
        Layout::stream_key_of(&self.table)
    }

    /// The stream's key of table `table` (before its layout is known).
    pub fn stream_key_of(table: &str) -> String {
        format!("hkv:{{{table}}}:stream")
    }
}

/// Encodes one row's value: `version | score | values`, little-endian.
pub fn encode_row(version: u64, score: u64, values: &[f32], out: &mut Vec<u8>) {
    out.reserve(ROW_HEADER + 4 * values.len());
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&score.to_le_bytes());
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// Decodes a row's header and writes its values into `values` (of `dim`
/// floats). `None` when the length is not the layout's.
pub fn decode_row(bytes: &[u8], values: &mut [f32]) -> Option<(u64, u64)> {
    if bytes.len() != ROW_HEADER + 4 * values.len() {
        return None;
    }
    let version = u64::from_le_bytes(bytes[0..8].try_into().ok()?);
    let score = u64::from_le_bytes(bytes[8..16].try_into().ok()?);
    for (v, c) in values.iter_mut().zip(bytes[ROW_HEADER..].chunks_exact(4)) {
        *v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
    Some((version, score))
}

/// Redis Cluster's hash slot of a hash tag's content: CRC16-XMODEM mod 16384.
pub fn slot(tag: &[u8]) -> u16 {
    crc16::State::<crc16::XMODEM>::calculate(tag) % SLOTS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_redis() {
        // Redis Cluster's own test vector: "123456789" → CRC16 0x31C3.
        assert_eq!(slot(b"123456789"), 0x31C3 % SLOTS);
        // `redis-cli cluster keyslot foo` = 12182.
        assert_eq!(slot(b"foo"), 12182);
    }

    #[test]
    fn rows_round_trip_bit_for_bit() {
        let vals = [f32::NAN, -0.0, 1.5, f32::from_bits(1)];
        let mut buf = Vec::new();
        encode_row(7, 9, &vals, &mut buf);
        let mut back = [0f32; 4];
        assert_eq!(decode_row(&buf, &mut back), Some((7, 9)));
        assert!(vals.iter().zip(&back).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert_eq!(decode_row(&buf[1..], &mut back), None);
    }

    #[test]
    fn keys_carry_their_group_tag() {
        let l = Layout::new("t", 2, 96);
        let k = l.row_key(42);
        let g = l.group(42);
        assert!(k.starts_with(format!("hkv:{{t:{g}}}:").as_bytes()));
        assert_eq!(&k[k.len() - 8..], &42u64.to_le_bytes());
        // Groups spread: 10 000 keys touch every one of 96 groups.
        let mut seen = [false; 96];
        (0..10_000u64).for_each(|k| seen[l.group(k) as usize] = true);
        assert!(seen.iter().all(|s| *s));
    }

    #[test]
    fn row_keys_parse_back_and_other_tables_do_not() {
        let l = Layout::new("t", 2, 96);
        for k in [0, 42, u64::MAX] {
            assert_eq!(l.parse_row_key(&l.row_key(k)), Some(k));
        }
        // `t:x`'s rows match `hkv:{t:*` but are not `t`'s.
        let other = Layout::new("t:x", 2, 96);
        assert_eq!(l.parse_row_key(&other.row_key(42)), None);
        // Another group's prefix, a short key, the meta hash: not rows.
        let mut wrong = Layout::new("t", 2, 96).row_key(42);
        wrong[6] ^= 1;
        assert_eq!(l.parse_row_key(&wrong), None);
        assert_eq!(l.parse_row_key(b"hkv:"), None);
        assert_eq!(l.parse_row_key(Layout::meta_key("t").as_bytes()), None);
        assert_eq!(Layout::new("a*[b]", 1, 3).scan_pattern(), br"hkv:{a\*\[b\]:*".to_vec());
    }
}
