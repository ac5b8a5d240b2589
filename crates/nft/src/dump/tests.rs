//! The readers' decoding of the kernel's bytes, by case.

use super::*;
use crate::atom::fields_len;

fn text(t: Tuple) -> String {
    t.to_string()
}

/// The byte layouts of netlink.rs's encoding tests, decoded back.
#[test]
fn tuples_decode_as_they_encode() {
    use Field::*;
    let n = 1u32.to_ne_bytes();
    let cases: &[(&[Field], Vec<u8>, &str)] = &[
        (
            &[Ipv4Addr, InetProto, InetService, Numgen(2)],
            [&[10, 0, 0, 1, 6, 0, 0, 0, 0, 80, 0, 0][..], &n].concat(),
            "10.0.0.1 . tcp . 80 . 1",
        ),
        (
            &[Ipv4Addr, InetService],
            vec![10, 244, 1, 2, 0x1f, 0x90, 0, 0],
            "10.244.1.2 . 8080",
        ),
        (
            &[InetProto, InetService],
            vec![17, 0, 0, 0, 0x75, 0x65, 0, 0],
            "udp . 30053",
        ),
        (&[Ipv4Addr], vec![10, 96, 0, 1], "10.96.0.1"),
        (&[InetService], vec![1, 0xbb], "443"),
        (
            &[Ipv6Addr],
            vec![0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
            "fd00::1",
        ),
    ];
    for (fields, bytes, want) in cases {
        let t = decode_tuple(fields, bytes).unwrap_or_else(|| panic!("{want}"));
        assert_eq!(&text(t), want);
        assert_eq!(bytes.len() as u32, fields_len(fields), "{want}");
    }
    // Wrong lengths are refused, never guessed.
    assert_eq!(decode_tuple(&[Ipv4Addr], &[1, 2, 3]), None);
    assert_eq!(decode_tuple(&[Ipv4Addr], &[1, 2, 3, 4, 5]), None);
    assert_eq!(
        decode_tuple(&[Ipv4Addr, InetService], &[1, 2, 3, 4, 0, 80]),
        None
    );
}

fn el(key: &[u8], end: bool) -> RawElement<'_> {
    RawElement {
        key,
        data: None,
        interval_end: end,
    }
}

#[test]
fn intervals_decode_to_prefixes() {
    let texts = |v: Vec<Tuple>| v.into_iter().map(text).collect::<Vec<_>>();
    let got = decode_intervals(
        false,
        [
            el(&[10, 245, 0, 0], true),
            el(&[10, 244, 0, 0], false),
            el(&[192, 168, 1, 8], true),
            el(&[192, 168, 1, 7], false),
        ],
    )
    .unwrap();
    assert_eq!(texts(got), ["10.244.0.0/16", "192.168.1.7/32"]);
    // An end element with no start is not an interval kproxy wrote (but one at the
    // bottom of the space is nft's marker).
    assert_eq!(decode_intervals(false, [el(&[10, 0, 0, 0], true)]), None);
    let got = decode_intervals(
        false,
        [
            el(&[0, 0, 0, 0], true),
            el(&[10, 0, 0, 0], false),
            el(&[11, 0, 0, 0], true),
        ],
    );
    assert_eq!(texts(got.unwrap()), ["10.0.0.0/8"]);
    // A range that is not a prefix.
    assert_eq!(
        decode_intervals(false, [el(&[10, 0, 0, 1], false), el(&[10, 0, 0, 4], true)]),
        None
    );
    // Up to the end of the space: no end element.
    let got = decode_intervals(false, [el(&[128, 0, 0, 0], false)]).unwrap();
    assert_eq!(texts(got), ["128.0.0.0/1"]);
}
