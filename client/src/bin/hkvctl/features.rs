//! Feature commands (`hash`, `find-features`, `find-or-insert-features`):
//! the hash flags, where features come from, how answers are printed.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use hkv_client::{proto, Client};

use crate::entries::table_info;
use crate::render::fmt_values;

/// How features become keys; without --kind and --num-buckets the table's setting applies.
#[derive(clap::Args, Clone)]
pub struct HashArgs {
    /// fingerprint64 (TensorFlow to_hash_bucket_fast) or strong (to_hash_bucket_strong).
    #[arg(long, value_parser = name::<proto::HashKind>)]
    pub kind: Option<proto::HashKind>,
    /// Keys are hash % num_buckets.
    #[arg(long)]
    pub num_buckets: Option<u64>,
    /// SipHash key of the strong hash: K0,K1 (needs --kind strong).
    #[arg(long, value_delimiter = ',')]
    pub key: Option<Vec<u64>>,
    /// The features are int64 (hashed as their decimal text, like as_string).
    #[arg(long)]
    pub int: bool,
}

/// Where features come from and how answers are printed.
#[derive(clap::Args, Clone)]
pub struct Input {
    /// Read the features (or FEATURE=V1,... entries) from FILE, `-` for
    /// standard input: one a line, or NUL-separated with -0. Sent in one request.
    #[arg(long, value_name = "FILE")]
    pub from: Option<PathBuf>,
    /// With --from: items are separated by NUL bytes, not newlines (features
    /// that hold newlines).
    #[arg(short = '0', long = "null", requires = "from")]
    pub null: bool,
    /// Print one JSON object a line ({"feature": .., "key": ..} / {"feature":
    /// .., "values": [..]} / {"feature": .., "found": false}).
    #[arg(long)]
    pub json: bool,
}

impl Input {
    /// The items: the arguments, or those of --from.
    pub fn items(&self, args: Vec<String>) -> Result<Vec<String>> {
        let Some(path) = &self.from else { return Ok(args) };
        if !args.is_empty() {
            bail!("give features as arguments or with --from, not both");
        }
        let mut bytes = vec![];
        if path.as_os_str() == "-" {
            std::io::Read::read_to_end(&mut std::io::stdin(), &mut bytes).context("reading standard input")?;
        } else {
            bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        }
        let text = String::from_utf8(bytes).with_context(|| format!("{} is not UTF-8 text", path.display()))?;
        let sep = if self.null { '\0' } else { '\n' };
        let mut items: Vec<String> = text.split(sep).map(|l| l.strip_suffix('\r').unwrap_or(l).to_string()).collect();
        if items.last().is_some_and(|l| l.is_empty()) {
            items.pop();
        }
        Ok(items)
    }

    /// One answer line: `FEATURE: WHAT` (the feature escaped when a newline,
    /// tab, control character or backslash would make the line ambiguous),
    /// or a JSON object.
    pub fn line(&self, feature: &str, what: Answer) {
        if self.json {
            let v = match what {
                Answer::Key(k) => serde_json::json!({"feature": feature, "key": k}),
                Answer::Values(v) => serde_json::json!({"feature": feature, "values": v}),
                Answer::Missing => serde_json::json!({"feature": feature, "found": false}),
            };
            println!("{v}");
            return;
        }
        let shown: std::borrow::Cow<str> = if feature.chars().any(|c| c.is_control() || c == '\\') {
            feature.escape_default().to_string().into()
        } else {
            feature.into()
        };
        match what {
            Answer::Key(k) => println!("{shown}: {k}"),
            Answer::Values(v) => println!("{shown}: {}", fmt_values(v)),
            Answer::Missing => println!("{shown}: not found"),
        }
    }
}

/// What one feature got.
pub enum Answer<'a> {
    Key(u64),
    Values(&'a [f32]),
    Missing,
}

impl HashArgs {
    pub fn spec(&self) -> Result<proto::HashSpec> {
        Ok(match feature_hash("--kind", &self.kind, self.num_buckets, &self.key)? {
            None => proto::HashSpec::Table,
            Some(h) => proto::HashSpec::Given(h),
        })
    }

    pub fn features(&self, items: &[String]) -> Result<proto::Features> {
        if self.int {
            let v = items
                .iter()
                .map(|x| x.trim().parse::<i64>().with_context(|| format!("{x:?} is not an int64 feature")))
                .collect::<Result<Vec<_>>>()?;
            Ok(proto::Features::Int64(v))
        } else {
            Ok(proto::Features::strings(items))
        }
    }
}

/// A name flag (`--policy`, `--kind`) parsed as its enum; the error lists
/// the names.
pub fn name<T: std::str::FromStr<Err = proto::ProtoError>>(s: &str) -> std::result::Result<T, String> {
    s.parse().map_err(|e: proto::ProtoError| e.message)
}

/// A hash setting from its flags: none without a kind or bucket count; a
/// kind (`flag`) without --num-buckets is an error.
pub fn feature_hash(
    flag: &str,
    kind: &Option<proto::HashKind>,
    num_buckets: Option<u64>,
    key: &Option<Vec<u64>>,
) -> Result<Option<proto::FeatureHash>> {
    if let Some(k) = key {
        let key_flag = if flag == "--hash" { "--hash-key" } else { "--key" };
        if *kind != Some(proto::HashKind::Strong) {
            bail!("{key_flag} is the SipHash key of the strong hash: add {flag} strong");
        }
        if k.len() != 2 {
            bail!("{key_flag} takes two u64 numbers, K0,K1; got {}", k.len());
        }
    }
    Ok(match (kind, num_buckets) {
        (None, None) => None,
        (_, None) => bail!("{flag} needs --num-buckets"),
        (kind, Some(num_buckets)) => Some(proto::FeatureHash {
            kind: kind.unwrap_or_default(),
            num_buckets,
            key: key.as_ref().map(|k| [k[0], k.get(1).copied().unwrap_or(0)]).unwrap_or([0, 0]),
        }),
    })
}

/// `hkvctl hash`: one line per feature, `FEATURE: KEY`.
pub fn hash(
    c: &mut Client,
    features: Vec<String>,
    input: &Input,
    hash: &HashArgs,
    table: Option<String>,
) -> Result<()> {
    let spec = hash.spec()?;
    if table.is_none() && spec == proto::HashSpec::Table {
        bail!("which hash? give --num-buckets N (with --kind and --key as needed), or --table T for a table's own");
    }
    let features = input.items(features)?;
    let keys = c.hash(table.as_deref().unwrap_or(""), spec, hash.features(&features)?)?;
    for (f, k) in features.iter().zip(keys) {
        input.line(f, Answer::Key(k));
    }
    Ok(())
}

/// `hkvctl find-features`: one line per feature, its values or `not found`.
pub fn find_features(c: &mut Client, table: &str, features: Vec<String>, input: &Input, hash: &HashArgs) -> Result<()> {
    let features = input.items(features)?;
    let f = c.find_features(table, hash.spec()?, hash.features(&features)?, false)?;
    let dim = if features.is_empty() { 0 } else { f.values.len() / features.len() };
    for (i, feature) in features.iter().enumerate() {
        let row = &f.values[i * dim..(i + 1) * dim];
        input.line(feature, if f.found[i] { Answer::Values(row) } else { Answer::Missing });
    }
    Ok(())
}

/// `hkvctl find-or-insert-features`: `FEATURE=V1,V2,...` entries; prints
/// the values stored for each feature, then the summary.
pub fn find_or_insert_features(
    c: &mut Client,
    table: &str,
    entries: Vec<String>,
    input: &Input,
    hash: &HashArgs,
    scores: Option<Vec<u64>>,
) -> Result<()> {
    let entries = input.items(entries)?;
    let info = table_info(c, table)?;
    let dim = info.row_dim();
    let mut names = vec![];
    let mut values = vec![];
    let mut given = std::collections::HashMap::new();
    for e in &entries {
        let (f, v) = e.rsplit_once('=').with_context(|| format!("{e:?}: expected FEATURE=V1,V2,..."))?;
        let v = v.split(',').map(crate::entries::parse_value).collect::<Result<Vec<_>>>()?;
        crate::entries::check_width(e, v.len(), &info)?;
        // As put refuses a key given twice: one batch would write the key
        // twice, in no set order. An int64 feature is the number (`07` is
        // `7`), hashed as its decimal text.
        let same = match f.trim().parse::<i64>() {
            Ok(n) if hash.int => n.to_string(),
            _ => f.to_string(),
        };
        if let Some(first) = given.insert(same, e) {
            bail!("feature {f:?} is given twice ({first:?} and {e:?}); give each feature once");
        }
        names.push(f.to_string());
        values.extend(v);
    }
    let w = c.find_or_insert_features(table, hash.spec()?, hash.features(&names)?, &values, scores.as_deref())?;
    let stored = w.values.unwrap_or_default();
    for (i, f) in names.iter().enumerate() {
        input.line(f, Answer::Values(&stored[i * dim..(i + 1) * dim]));
    }
    if !input.json {
        println!("{}", found_or_inserted(&w.summary));
    }
    Ok(())
}

/// A find_or_insert's summary: the keys it found (the daemon counts them
/// as `updated`, though nothing was written: a tester read "1 updated" for
/// a row left as it was), those it inserted, those it refused.
fn found_or_inserted(s: &proto::Summary) -> String {
    let mut o = format!("{} found, {} inserted", s.updated, s.inserted_total());
    if s.evicted > 0 {
        o += &format!(" ({} of them by evicting another entry)", s.evicted);
    }
    o + &format!(", {} rejected", s.rejected)
}
