//! Listing a namespace: every shard's names, merged in key order.
//!
//! A namespace's blobs are spread over all shards by the hash of their
//! keys; each shard lists its own in key order (`BlobService.List`, a page
//! at a time). [`Lister`] keeps one page per shard and repeatedly yields
//! the smallest key at the fronts, fetching a shard's next page when its
//! buffer runs dry, so memory stays at one page per shard however large the
//! namespace. The last key yielded is a complete pagination token: a new
//! listing that starts after it continues exactly where this one stopped,
//! even under another cluster map.

use std::collections::VecDeque;

use tidepool_proto::v1::blob_service_client::BlobServiceClient;
use tidepool_proto::v1::{BlobKind, ErrorCode, ListRequest, ListResponse, ReadConsistency};

use crate::client::Client;
use crate::error::{Error, Result};

/// What to list.
#[derive(Clone, Debug, Default)]
pub struct ListOptions {
    /// Only keys that start with these bytes.
    pub prefix: Vec<u8>,
    /// Only keys after this one (a pagination token: the last key of an
    /// earlier listing).
    pub start_after: Option<Vec<u8>>,
    /// Entries asked of a shard at a time (0: 1,000; at most 10,000).
    pub page_size: u32,
}

/// One listed blob.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListEntry {
    /// Its key.
    pub key: Vec<u8>,
    /// Size in bytes (of the whole blob, for a chunked one).
    pub size: u64,
    /// SHA-256 of the whole blob.
    pub sha256: [u8; 32],
    /// Epoch of its last write or touch.
    pub epoch: u64,
    /// Stored as chunks plus a manifest.
    pub chunked: bool,
}

/// One page of a listing ([`Client::list_page`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListPage {
    /// Entries in key order.
    pub entries: Vec<ListEntry>,
    /// Where the next page starts (`ListOptions::start_after`); `None` when
    /// nothing follows.
    pub next: Option<Vec<u8>>,
    /// A shard said it holds blobs stored before keys were indexed (by an
    /// older version): they are missing from this page and may be missing
    /// from the others ([`Lister::incomplete`]). A caller deciding from a
    /// listing what is unreferenced (garbage collection) must not act on
    /// an incomplete one.
    pub incomplete: bool,
}

/// One shard's side of a listing.
struct ShardCursor {
    shard_id: u32,
    /// Its range in the map the listing was planned from.
    range: (u64, u64),
    buffer: VecDeque<ListEntry>,
    /// The shard has nothing after `buffer`.
    done: bool,
    /// The last key the shard examined: its next page starts after it.
    resume_after: Option<Vec<u8>>,
}

/// A listing in progress ([`Client::list`]): call [`Lister::next`] until it
/// returns `None`.
pub struct Lister {
    client: Client,
    namespace: String,
    prefix: Vec<u8>,
    page_size: u32,
    shards: Vec<ShardCursor>,
    started: bool,
    incomplete: bool,
    last: Option<Vec<u8>>,
}

impl Lister {
    /// The next blob in key order, or `None` at the end.
    pub async fn next(&mut self) -> Result<Option<ListEntry>> {
        // A loop, not a recursion: a listing that meets thousands of
        // chunked blobs deleted since their page was read must not nest a
        // future per blob.
        loop {
            if let Some(answer) = self.step().await? {
                return Ok(answer);
            }
        }
    }

    /// One try at [`Lister::next`]: `None` to try again (the listing was
    /// planned again after a split, or the blob it would return was
    /// deleted since it was listed).
    async fn step(&mut self) -> Result<Option<Option<ListEntry>>> {
        if !self.started {
            self.start().await?;
        }
        // Every shard that may hold a smaller key must show its front.
        let mut pending = tokio::task::JoinSet::new();
        loop {
            for cursor in &mut self.shards {
                if cursor.buffer.is_empty() && !cursor.done {
                    let client = self.client.clone();
                    let (namespace, prefix) = (self.namespace.clone(), self.prefix.clone());
                    let (shard_id, after) = (cursor.shard_id, cursor.resume_after.clone());
                    let page_size = self.page_size;
                    pending.spawn(async move {
                        let page =
                            fetch(&client, &namespace, shard_id, &prefix, after, page_size).await;
                        (shard_id, page)
                    });
                }
            }
            if pending.is_empty() {
                break;
            }
            while let Some(joined) = pending.join_next().await {
                let (shard_id, page) = joined
                    .map_err(|e| Error::new(ErrorCode::Internal, format!("list task: {e}")))?;
                let page = page?;
                let planned = self
                    .shards
                    .iter()
                    .find(|c| c.shard_id == shard_id)
                    .map(|c| c.range);
                if let (Some(now), Some(planned)) = (page.range, planned)
                    && (now.start > planned.0 || now.end < planned.1)
                {
                    // The shard split since the listing read the map: its
                    // pages no longer cover the rest. List again from the
                    // last key returned, over a map that shows the new
                    // shard (nothing is lost or repeated: keys come out in
                    // order, and every shard starts after that key).
                    pending.abort_all();
                    self.replan(shard_id, (now.start, now.end)).await?;
                    return Ok(None);
                }
                self.incomplete |= page.incomplete;
                let cursor = self
                    .shards
                    .iter_mut()
                    .find(|c| c.shard_id == shard_id)
                    .expect("a cursor per shard");
                // A page must continue where the last one ended, in order.
                let mut floor = cursor.resume_after.clone();
                for entry in page.entries {
                    if floor.as_ref().is_some_and(|f| entry.key <= *f) {
                        return Err(Error::new(
                            ErrorCode::Internal,
                            format!("shard {shard_id} listed keys out of order"),
                        ));
                    }
                    floor = Some(entry.key.clone());
                    cursor.buffer.push_back(listed(entry)?);
                }
                cursor.done = page.done;
                if !page.done {
                    if floor.as_ref().is_some_and(|f| page.resume_after < *f) {
                        return Err(Error::new(
                            ErrorCode::Internal,
                            format!("shard {shard_id} resumes a listing before its last key"),
                        ));
                    }
                    cursor.resume_after = Some(page.resume_after);
                }
            }
        }
        let smallest = self
            .shards
            .iter()
            .enumerate()
            .filter(|(_, c)| !c.buffer.is_empty())
            .min_by(|(_, a), (_, b)| a.buffer[0].key.cmp(&b.buffer[0].key))
            .map(|(i, _)| i);
        let Some(smallest) = smallest else {
            return Ok(Some(None));
        };
        // Taken from the buffer only once it is answered: a caller retrying
        // after a failed look-up must get this entry again, not the next.
        let mut entry = self.shards[smallest].buffer[0].clone();
        if entry.chunked {
            // The manifest's own size and digest are not the blob's; and
            // the key may hold another blob by now.
            let now = self.client.listed_now(&self.namespace, &entry.key).await?;
            self.shards[smallest].buffer.pop_front();
            match now {
                Some(now) => entry = now,
                // Deleted since it was listed.
                None => return Ok(None),
            }
        } else {
            self.shards[smallest].buffer.pop_front();
        }
        self.last = Some(entry.key.clone());
        Ok(Some(Some(entry)))
    }

    /// True once a shard said it holds blobs stored before keys were indexed
    /// (by an older version): those are missing from the listing.
    pub fn incomplete(&self) -> bool {
        self.incomplete
    }

    /// The last key returned: a listing started after it continues this one.
    pub fn token(&self) -> Option<&[u8]> {
        self.last.as_deref()
    }

    async fn start(&mut self) -> Result<()> {
        let map = self.client.refresh_map().await?;
        if !map.namespaces.iter().any(|ns| ns.name == self.namespace) {
            return Err(Error::new(
                ErrorCode::NamespaceNotFound,
                format!("no namespace {:?}", self.namespace),
            ));
        }
        let start_after = self.last.clone();
        self.shards = map
            .shards
            .iter()
            .map(|shard| ShardCursor {
                shard_id: shard.shard_id,
                range: (shard.hash_start, shard.hash_end),
                buffer: VecDeque::new(),
                done: false,
                resume_after: start_after.clone(),
            })
            .collect();
        self.started = true;
        Ok(())
    }
}

impl Lister {
    /// Plans the listing again once the map shows `shard_id` with the
    /// narrower `range` it answered with (the coordinator publishes a split
    /// once the new shard has a leader: a moment after the split applies).
    async fn replan(&mut self, shard_id: u32, range: (u64, u64)) -> Result<()> {
        const ATTEMPTS: u32 = 100;
        for _ in 0..ATTEMPTS {
            let map = self.client.refresh_map().await?;
            let shown = map
                .shards
                .iter()
                .find(|s| s.shard_id == shard_id)
                .is_none_or(|s| s.hash_start >= range.0 && s.hash_end <= range.1);
            if shown {
                return self.start().await;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        Err(Error::new(
            ErrorCode::StaleMap,
            format!(
                "shard {shard_id} split during the listing and the cluster map does not show it yet; list again after the last key returned"
            ),
        ))
    }
}

fn listed(entry: tidepool_proto::v1::ListEntry) -> Result<ListEntry> {
    let info = entry
        .info
        .ok_or_else(|| Error::new(ErrorCode::Internal, "a listed blob without metadata"))?;
    let sha256 =
        info.sha256.as_slice().try_into().map_err(|_| {
            Error::new(ErrorCode::Internal, "a listed SHA-256 that is not 32 bytes")
        })?;
    Ok(ListEntry {
        key: entry.key,
        size: info.size,
        sha256,
        epoch: info.epoch,
        chunked: info.kind == BlobKind::Manifest as i32,
    })
}

async fn fetch(
    client: &Client,
    namespace: &str,
    shard_id: u32,
    prefix: &[u8],
    start_after: Option<Vec<u8>>,
    page_size: u32,
) -> Result<ListResponse> {
    let start_after = start_after.unwrap_or_default();
    client
        .on_shard_id(namespace, shard_id, |channel, map_version, shard_id| {
            let request = ListRequest {
                namespace: namespace.to_string(),
                shard_id,
                prefix: prefix.to_vec(),
                start_after: start_after.clone(),
                limit: page_size,
                consistency: ReadConsistency::Linearizable as i32,
                map_version,
            };
            async move {
                BlobServiceClient::new(channel)
                    .list(request)
                    .await
                    .map(|r| r.into_inner())
            }
        })
        .await
}

impl Client {
    /// Lists `namespace`'s blobs in key order, merged across shards (see
    /// the module docs). Nothing is fetched until the first
    /// [`Lister::next`].
    pub fn list(&self, namespace: &str, options: ListOptions) -> Lister {
        Lister {
            client: self.clone(),
            namespace: namespace.to_string(),
            prefix: options.prefix,
            page_size: options.page_size,
            shards: Vec::new(),
            started: false,
            incomplete: false,
            last: options.start_after,
        }
    }

    /// At most `max` of `namespace`'s blobs in key order, and where the
    /// next page starts.
    pub async fn list_page(
        &self,
        namespace: &str,
        options: ListOptions,
        max: usize,
    ) -> Result<ListPage> {
        if max == 0 {
            // A page of nothing cannot say whether more follows.
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                "a page holds at least one entry",
            ));
        }
        let page_size = options
            .page_size
            .max((max as u32).saturating_add(1).min(10_000));
        let mut lister = self.list(
            namespace,
            ListOptions {
                page_size,
                ..options
            },
        );
        let mut entries = Vec::new();
        while entries.len() < max {
            match lister.next().await? {
                Some(entry) => entries.push(entry),
                None => {
                    return Ok(ListPage {
                        entries,
                        next: None,
                        incomplete: lister.incomplete(),
                    });
                }
            }
        }
        // Full: more follows only if another entry does.
        let next = match lister.next().await? {
            Some(_) => entries.last().map(|e| e.key.clone()),
            None => None,
        };
        Ok(ListPage {
            entries,
            next,
            incomplete: lister.incomplete(),
        })
    }
}
