//! The one encoding of everything a node persists or sends its peers: a format-version byte,
//! then the value in postcard (binary, compact, driven by the same serde derives).
//!
//! Log entries, the vote, the state machine's rows, snapshots and Raft messages are all read,
//! some day, by another build: a node restarted after an upgrade, a peer on the next version.
//! So each starts with the version of the format it was written in, and a reader that does not
//! know that version says so instead of guessing. From disk that is a storage error, which stops
//! the node; from a peer it is a refused message, and the node keeps running (nothing decoded
//! from the network can stop a node).
//!
//! The version covers the bytes, not the rules that apply them: what an entry *means* is the
//! state machine's business.

use serde::de::DeserializeOwned;
use serde::Serialize;

/// The format this build writes, and the only one it reads.
///
/// History: 1, the first binary format; 2, placement decided by the leader (a `Place` command,
/// a partition row's `next` receiver, the revoke budget in the configuration); 3, session
/// secrets kept and carried only as hashes; 4, each member's peer and client addresses (two
/// listeners); 5, operator settings (maintenance mode, weights by name) in the state and its
/// snapshots, and the commands that change them; 6, partitions pinned to a worker name in the
/// operator settings, and the `Pin` command; 7, the lease TTL and the revoke budget changed at run
/// time (`SetLeaseTtl`, `SettleLeaseTtl`, `SetRevokeBudget`, an unsettled TTL change in the
/// configuration); 8, a partition row's mark that its grant ends a move, so a new leader counts
/// unconfirmed moves toward the revoke budget; 9, namespaces: a log entry names the namespace it
/// acts on (or deletes one), snapshots carry every namespace's table, and the state machine's
/// rows are keyed by namespace. An older store is refused by name rather than
/// read as something it is not.
pub const FORMAT: u8 = 9;

/// Why bytes could not be read as a value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    #[error("no bytes: not even a format version")]
    Empty,
    #[error("format version {0} is not one this build reads (it reads version {FORMAT})")]
    UnknownVersion(u8),
    #[error("malformed version-{FORMAT} value: {0}")]
    Payload(#[from] postcard::Error),
    #[error("{0} bytes left over after the value")]
    Trailing(usize),
}

/// `value` in the current format.
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Vec<u8> {
    let mut bytes = vec![FORMAT];
    // Writing into a Vec cannot fail, and every type tenure stores has a serde derive that
    // knows its lengths; a failure here is a bug in this build, not bad input.
    postcard::to_io(value, &mut bytes).expect("tenure's own types always encode");
    bytes
}

/// A value of the current format; anything else (another version, a truncated or padded
/// value) is an error, never a guess.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, FormatError> {
    match bytes.split_first() {
        None => Err(FormatError::Empty),
        Some((&FORMAT, payload)) => {
            let (value, rest) = postcard::take_from_bytes(payload)?;
            if rest.is_empty() {
                Ok(value)
            } else {
                Err(FormatError::Trailing(rest.len()))
            }
        }
        Some((&version, _)) => Err(FormatError::UnknownVersion(version)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ownership::Command;

    #[test]
    fn what_is_written_reads_back_and_anything_else_is_refused() {
        let command =
            Command::Join { name: "w1".into(), weight: 2, secret: crate::ownership::SecretHash::of("s") };
        let bytes = encode(&command);
        assert_eq!(bytes[0], FORMAT);
        assert_eq!(decode::<Command>(&bytes), Ok(command));

        let mut other = bytes.clone();
        other[0] = FORMAT + 1;
        assert_eq!(decode::<Command>(&other), Err(FormatError::UnknownVersion(FORMAT + 1)));
        assert_eq!(decode::<Command>(&[]), Err(FormatError::Empty));
        assert!(matches!(decode::<Command>(&bytes[..bytes.len() - 1]), Err(FormatError::Payload(_))));
        let mut padded = bytes.clone();
        padded.push(0);
        assert_eq!(decode::<Command>(&padded), Err(FormatError::Trailing(1)));
        assert!(decode::<Command>(&[FORMAT, 0xff, 0xff, 0xff]).is_err());
    }
}
