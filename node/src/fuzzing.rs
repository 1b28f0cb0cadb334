//! Decoders of bytes a node reads from its disk or its peers, with
//! well-formed inputs, for the fuzzing test
//! (`tests/decoders_survive_hostile_bytes.rs`): commands, raft record
//! metadata, the replica's application state (with its sessions), the
//! stored blob header, snapshot manifests and Raft messages from peers.
//!
//! Not part of the node's API: hidden, and used only by that test.

use prost::Message as _;
use prost011::Message as _;
use raft::eraftpb::{Entry, EntryType, Message, MessageType};
use tidepool_proto::v1::{BlobKind, NodeAddress, SnapshotFile, SnapshotManifest};

use crate::command::{Command, WriteOp};
use crate::session::{SessionTag, Sessions};

/// A decoder and its seeds: `(name, seeds, decode)`; `decode` returns
/// whether the input was accepted.
pub type Target = (&'static str, Vec<Vec<u8>>, Box<dyn Fn(&[u8]) -> bool>);

fn tag(seq: u64) -> Option<SessionTag> {
    Some(SessionTag {
        id: 0x1234_5678_9abc_def0,
        seq,
        opens: seq == 1,
        time_ms: 1_764_000_000_000,
    })
}

fn commands() -> Vec<Command> {
    vec![
        Command::Write(vec![
            WriteOp {
                value: Some(vec![9; 64]),
                namespace: 1,
                epoch: 2,
                key: [3; 32],
                name: b"a/b".to_vec(),
                session: tag(1),
                if_absent: true,
            },
            WriteOp {
                value: None,
                namespace: 1,
                epoch: 2,
                key: [4; 32],
                name: Vec::new(),
                session: None,
                if_absent: false,
            },
        ]),
        Command::Touch {
            namespace: 1,
            epoch: 3,
            key: [5; 32],
            session: tag(2),
        },
        Command::AdvanceEpoch(4),
        Command::DropEpochs {
            namespace: 3,
            below: 2,
        },
        Command::Noop,
    ]
}

fn entry(data: Vec<u8>, entry_type: EntryType) -> Entry {
    Entry {
        entry_type: entry_type as i32,
        term: 3,
        index: 17,
        data,
        context: b"ctx".to_vec(),
        ..Entry::default()
    }
}

fn sessions() -> Sessions {
    let mut sessions = Sessions::starting_at(10);
    for id in 0..4u128 {
        let t = SessionTag {
            id,
            seq: 1,
            opens: true,
            time_ms: 1000,
        };
        sessions.admit(&t);
        sessions.record(&t, id % 2 == 0);
    }
    sessions.finish_entry(11, vec![0, 2]);
    sessions
}

fn snapshot_manifest() -> Vec<u8> {
    SnapshotManifest {
        shard_id: 2,
        snapshot_id: 9,
        raft_index: 100,
        raft_term: 4,
        files: vec![SnapshotFile {
            path: "a/wal/0000000000000001.wal".into(),
            size: 4096,
            sha256: vec![1; 32],
            file_size: 1 << 20,
        }],
        source: Some(NodeAddress {
            node_id: 1,
            address: "http://10.0.0.1:7400".into(),
        }),
    }
    .encode_to_vec()
}

fn raft_message() -> Vec<u8> {
    let mut message = Message::default();
    message.set_msg_type(MessageType::MsgAppend);
    message.from = 1;
    message.to = 2;
    message.term = 5;
    message.entries = vec![entry(commands()[0].encode(), EntryType::EntryNormal)];
    message.encode_to_vec()
}

/// Every decoder of what a node reads from disk or from its peers.
pub fn targets() -> Vec<Target> {
    let write = entry(commands()[0].encode(), EntryType::EntryNormal);
    let raw = entry(Command::AdvanceEpoch(4).encode(), EntryType::EntryNormal);
    let metas = crate::raftlog::fuzz_record_meta(&write, &raw).expect("well-formed entries");
    let app_state = crate::raftlog::fuzz_app_state(&sessions());
    let blob = crate::blob::encode(BlobKind::Manifest, &[7; 32], b"stored content");
    vec![
        (
            "command",
            commands().iter().map(Command::encode).collect(),
            Box::new(|b: &[u8]| Command::decode(b).is_ok()),
        ),
        (
            "raft record metadata",
            metas,
            Box::new(crate::raftlog::fuzz_parse_meta),
        ),
        (
            "application state",
            vec![app_state],
            Box::new(crate::raftlog::fuzz_decode_app_state),
        ),
        (
            "stored blob header",
            vec![blob],
            Box::new(|b: &[u8]| crate::blob::decode(b).is_ok()),
        ),
        (
            "snapshot manifest",
            vec![snapshot_manifest()],
            Box::new(|b: &[u8]| SnapshotManifest::decode(b).is_ok()),
        ),
        (
            "raft message",
            vec![raft_message()],
            Box::new(|b: &[u8]| Message::decode(b).is_ok()),
        ),
    ]
}
