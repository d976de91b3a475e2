//! The documented hash and the partition ranges: test vectors and exact coverage.

use proptest::prelude::*;
use tenure::ids::PartitionId;
use tenure::keyspace::{hash_key, KeySpace, MAX_PARTITIONS};

#[test]
fn hash_matches_published_xxhash64_vectors() {
    // Reference values of XXH64 with seed 0.
    assert_eq!(hash_key(b""), 0xef46_db37_51d8_e999);
    assert_eq!(hash_key(b"a"), 0xd24e_c4f1_a98c_6e5b);
    assert_eq!(hash_key(b"abc"), 0x44bc_2cf5_ad77_0999);
}

#[test]
fn documented_partitions_of_keys() {
    let space = KeySpace::new(256).unwrap();
    assert_eq!(space.partition_of_key(b""), PartitionId(0xef));
    assert_eq!(space.partition_of_key(b"a"), PartitionId(0xd2));
    assert_eq!(space.partition_of_key(b"abc"), PartitionId(0x44));
}

#[test]
fn ranges_cover_the_hash_space_exactly() {
    for count in [1u32, 2, 3, 7, 256, 1000, 65536] {
        let space = KeySpace::new(count).unwrap();
        let mut next = 0u128;
        for p in 0..count {
            let r = space.range(PartitionId(p)).unwrap();
            assert_eq!(r.start as u128, next, "partition {p} of {count} starts where the previous ended");
            assert!(r.end >= r.start);
            assert_eq!(space.partition_of_hash(r.start), PartitionId(p));
            assert_eq!(space.partition_of_hash(r.end), PartitionId(p));
            next = r.end as u128 + 1;
        }
        assert_eq!(next, 1u128 << 64, "the last range ends at u64::MAX for {count}");
        assert!(space.range(PartitionId(count)).is_none());
    }
}

#[test]
fn a_million_partitions_are_supported() {
    let space = KeySpace::new(1_000_000).unwrap();
    let last = space.range(PartitionId(999_999)).unwrap();
    assert_eq!(last.end, u64::MAX);
    assert_eq!(space.partition_of_hash(u64::MAX), PartitionId(999_999));
}

#[test]
fn bad_partition_counts_are_refused() {
    assert!(KeySpace::new(0).is_err());
    assert!(KeySpace::new(MAX_PARTITIONS + 1).is_err());
    assert!(KeySpace::new(MAX_PARTITIONS).is_ok());
}

proptest! {
    #[test]
    fn every_hash_falls_in_the_range_of_its_partition(hash in any::<u64>(), count in 1u32..2_000_000) {
        let space = KeySpace::new(count).unwrap();
        let p = space.partition_of_hash(hash);
        let r = space.range(p).unwrap();
        prop_assert!(r.start <= hash && hash <= r.end);
    }
}
