//! A fenced store on an object store that offers nothing but conditional writes, checked by the
//! fence kit's conformance suite.
//!
//! Object stores (S3 with `If-Match`, GCS with generation preconditions, Azure with ETags) have
//! no transactions across objects, so the fence and the data cannot live in separate objects:
//! an owner could pass the check on one and be overtaken before it writes the other. Here each
//! partition is one object holding its fence, its data and its checkpoint. A change reads the
//! object and its version, checks the token against the fence in it, and writes the new object
//! on the condition that the version is still the one it read; if another writer got in between,
//! it reads again and decides again. The check and the write are thus one step, as the suite
//! requires, with no lock anywhere.
//!
//! The bucket below is a stand-in that keeps objects in memory and implements the one primitive
//! that matters, a put conditional on the version; a real adapter maps `put_if` onto its
//! service's precondition header and changes nothing else. The bucket outlives the store that
//! uses it, so "restarting" the store (making a new one on the same bucket) keeps everything,
//! and the suite's durability case runs too.
//!
//! Run: `cargo run --example object_store_fence`

use anyhow::{bail, Result};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use tenure::fence::testing::{self, Backend};
use tenure::fence::{admits, BatchOp, FenceBatch, FenceError, FenceStore};
use tenure::ids::{FencingToken, PartitionId};

/// An object's version, as the service reports it (an ETag, a generation).
type Version = u64;

/// The object-store primitive: get with its version, put only if the version is unchanged
/// (`None`: only if the object does not exist yet).
#[derive(Default)]
struct Bucket {
    objects: Mutex<HashMap<String, (Version, Vec<u8>)>>,
}

#[derive(Debug)]
struct PreconditionFailed;

/// Each call is a round trip to the service: other writers get in meanwhile.
impl Bucket {
    async fn get(&self, name: &str) -> Option<(Version, Vec<u8>)> {
        tokio::task::yield_now().await;
        self.objects.lock().expect("bucket lock poisoned").get(name).cloned()
    }

    async fn put_if(
        &self,
        name: &str,
        expected: Option<Version>,
        body: Vec<u8>,
    ) -> Result<(), PreconditionFailed> {
        tokio::task::yield_now().await;
        let mut objects = self.objects.lock().expect("bucket lock poisoned");
        let current = objects.get(name).map(|(v, _)| *v);
        if current != expected {
            return Err(PreconditionFailed);
        }
        objects.insert(name.to_string(), (current.map_or(1, |v| v + 1), body));
        Ok(())
    }
}

/// One partition's object: its fence, its data and its checkpoint, as JSON (the data as pairs,
/// since JSON keys are strings and these are bytes).
#[derive(Default)]
struct PartitionObject {
    fence: Option<u64>,
    data: BTreeMap<Vec<u8>, Vec<u8>>,
    checkpoint: Option<Vec<u8>>,
}

impl PartitionObject {
    fn encode(&self) -> Vec<u8> {
        let data: Vec<(&Vec<u8>, &Vec<u8>)> = self.data.iter().collect();
        serde_json::json!({ "fence": self.fence, "data": data, "checkpoint": self.checkpoint })
            .to_string()
            .into_bytes()
    }

    fn decode(body: &[u8]) -> Result<PartitionObject, serde_json::Error> {
        #[allow(clippy::type_complexity)]
        let (fence, data, checkpoint): (Option<u64>, Vec<(Vec<u8>, Vec<u8>)>, Option<Vec<u8>>) = {
            let v: serde_json::Value = serde_json::from_slice(body)?;
            (
                serde_json::from_value(v["fence"].clone())?,
                serde_json::from_value(v["data"].clone())?,
                serde_json::from_value(v["checkpoint"].clone())?,
            )
        };
        Ok(PartitionObject { fence, data: data.into_iter().collect(), checkpoint })
    }
}

/// A [`FenceStore`] on a bucket: one object per partition, changed by compare-and-swap.
struct ObjectFence {
    bucket: Arc<Bucket>,
}

fn object_name(p: PartitionId) -> String {
    format!("partitions/{:08}", p.0)
}

impl ObjectFence {
    async fn load(&self, p: PartitionId) -> Result<(Option<Version>, PartitionObject), FenceError> {
        match self.bucket.get(&object_name(p)).await {
            None => Ok((None, PartitionObject::default())),
            Some((version, body)) => {
                let object = PartitionObject::decode(&body)
                    .map_err(|e| FenceError::Backend(format!("unreadable object for {p}: {e}")))?;
                Ok((Some(version), object))
            }
        }
    }

    /// Checks `token` against the fence in the object as read, applies `change`, and writes it
    /// back on the condition that nobody wrote in between; otherwise decides again on what the
    /// other writer left. A stale token changes nothing.
    async fn update(
        &self,
        p: PartitionId,
        token: FencingToken,
        change: impl Fn(&mut PartitionObject) + Send,
    ) -> Result<(), FenceError> {
        loop {
            let (version, mut object) = self.load(p).await?;
            let highest = object.fence.map(FencingToken);
            if !admits(highest, token) {
                return Err(FenceError::Stale { partition: p, token, highest: highest.unwrap_or_default() });
            }
            object.fence = Some(token.0);
            change(&mut object);
            let body = object.encode();
            match self.bucket.put_if(&object_name(p), version, body).await {
                Ok(()) => return Ok(()),
                Err(PreconditionFailed) => continue, // someone else wrote: look again
            }
        }
    }
}

impl FenceStore for ObjectFence {
    async fn raise(&self, partition: PartitionId, token: FencingToken) -> Result<(), FenceError> {
        self.update(partition, token, |_| {}).await
    }

    async fn apply(
        &self,
        partition: PartitionId,
        token: FencingToken,
        batch: &FenceBatch,
    ) -> Result<(), FenceError> {
        self.update(partition, token, |object| {
            for op in batch.ops() {
                match op {
                    BatchOp::Put { key, value } => {
                        object.data.insert(key.clone(), value.clone());
                    }
                    BatchOp::Delete { key } => {
                        object.data.remove(key);
                    }
                }
            }
            if let Some(checkpoint) = batch.new_checkpoint() {
                object.checkpoint = Some(checkpoint.to_vec());
            }
        })
        .await
    }

    async fn read(&self, partition: PartitionId, key: &[u8]) -> Result<Option<Vec<u8>>, FenceError> {
        Ok(self.load(partition).await?.1.data.get(key).cloned())
    }

    async fn checkpoint(
        &self,
        partition: PartitionId,
        token: FencingToken,
    ) -> Result<Option<Vec<u8>>, FenceError> {
        let (_, object) = self.load(partition).await?;
        let highest = object.fence.map(FencingToken);
        if !admits(highest, token) {
            return Err(FenceError::Stale { partition, token, highest: highest.unwrap_or_default() });
        }
        Ok(object.checkpoint)
    }

    async fn highest(&self, partition: PartitionId) -> Result<Option<FencingToken>, FenceError> {
        Ok(self.load(partition).await?.1.fence.map(FencingToken))
    }
}

/// The suite's view: a bucket per case, which a reopened store finds again.
#[derive(Default)]
struct Buckets(Mutex<HashMap<&'static str, Arc<Bucket>>>);

impl Backend for Buckets {
    type Store = ObjectFence;

    async fn fresh(&self, case: &'static str) -> Result<ObjectFence, FenceError> {
        let bucket = Arc::new(Bucket::default());
        self.0.lock().expect("buckets lock poisoned").insert(case, bucket.clone());
        Ok(ObjectFence { bucket })
    }

    async fn reopen(
        &self,
        case: &'static str,
        store: ObjectFence,
    ) -> Result<Option<ObjectFence>, FenceError> {
        drop(store);
        let bucket = self.0.lock().expect("buckets lock poisoned").get(case).cloned();
        Ok(bucket.map(|bucket| ObjectFence { bucket }))
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    match testing::run_all(&Buckets::default()).await {
        Ok(passed) => {
            for case in &passed {
                println!("pass {case}");
            }
            println!("{} cases passed on the object-store fence", passed.len());
            Ok(())
        }
        Err(failure) => bail!("the object-store fence failed the suite: {failure}"),
    }
}
