//! Tuple packing: an element's key or value, its atoms held inline in 8-byte slots.

use std::net::IpAddr;

use crate::atom::{Atom, MAX_FIELDS};

/// A concatenation of atoms (one atom for a single-field key).
///
/// A full sync at 10k Services × 10 endpoints holds ≈ 106k elements, most with a tuple
/// as key and another as value, so their size is most of its transient memory; a heap
/// allocation each cost a quarter of its time. Tuples
/// without an IPv6 address (the common case) are held inline as one 8-byte `Slot` per
/// atom; the others (a 16-byte address does not fit a slot) as a boxed slice of atoms.
/// The representation is canonical (chosen by the atoms alone), so the derived
/// equality and hash are those of the atoms; the order is that of `(padded atoms,
/// len)` (see [`Ord for Tuple`](#impl-Ord-for-Tuple)).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Tuple(Repr);

#[derive(Clone, PartialEq, Eq, Hash)]
enum Repr {
    /// The first `len` slots are the tuple's; the rest are [`FILLER`]'s.
    Inline { slots: [Slot; MAX_FIELDS], len: u8 },
    /// A tuple with an IPv6 address.
    Boxed(Box<[Atom]>),
}

/// One atom other than an IPv6 address or prefix, as `[high, low]` halves of a `u64`
/// whose order is that of the atoms: the top byte is the variant (an IPv6 variant
/// keeps its place in [`Atom`]'s order but never occurs here), the rest the datum.
/// Two `u32`s rather than a `u64` so that a [`Tuple`] is 4-byte aligned inside.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Slot([u32; 2]);

const ADDR4: u64 = 0;
const PREFIX4: u64 = 2;
const PROTO: u64 = 4;
const PORT: u64 = 5;
const INDEX: u64 = 6;

impl Slot {
    fn of(a: Atom) -> Option<Slot> {
        let v = match a {
            Atom::Addr(IpAddr::V4(ip)) => ADDR4 << 56 | u64::from(u32::from(ip)),
            Atom::Prefix(IpAddr::V4(ip), len) => {
                PREFIX4 << 56 | u64::from(u32::from(ip)) << 8 | u64::from(len)
            }
            Atom::Addr(IpAddr::V6(_)) | Atom::Prefix(IpAddr::V6(_), _) => return None,
            Atom::Proto(p) => PROTO << 56 | u64::from(p),
            Atom::Port(p) => PORT << 56 | u64::from(p),
            Atom::Index(i) => INDEX << 56 | u64::from(i),
        };
        Some(Slot([(v >> 32) as u32, v as u32]))
    }

    fn atom(self) -> Atom {
        let v = u64::from(self.0[0]) << 32 | u64::from(self.0[1]);
        let datum = v & ((1 << 56) - 1);
        match v >> 56 {
            ADDR4 => Atom::Addr(IpAddr::V4((datum as u32).into())),
            PREFIX4 => Atom::Prefix(IpAddr::V4(((datum >> 8) as u32).into()), datum as u8),
            PROTO => Atom::Proto(datum as u8),
            PORT => Atom::Port(datum as u16),
            INDEX => Atom::Index(datum as u32),
            _ => unreachable!("a slot is only made by Slot::of"),
        }
    }
}

/// What pads a tuple to [`MAX_FIELDS`] atoms.
pub(super) const FILLER: Atom = Atom::Index(0);
const FILLER_SLOT: Slot = Slot([(INDEX << 24) as u32, 0]);

/// A tuple's atoms, by value (an inline tuple has no [`Atom`]s to lend).
#[derive(Clone, Copy)]
pub struct Atoms {
    atoms: [Atom; MAX_FIELDS],
    len: u8,
}

impl std::ops::Deref for Atoms {
    type Target = [Atom];
    fn deref(&self) -> &[Atom] {
        &self.atoms[..usize::from(self.len)]
    }
}

impl Tuple {
    /// Panics on more than [`MAX_FIELDS`] atoms: a kproxy declaration never has more
    /// (parsing refuses them).
    pub fn new(atoms: &[Atom]) -> Tuple {
        assert!(
            atoms.len() <= MAX_FIELDS,
            "a tuple of {} atoms",
            atoms.len()
        );
        let mut slots = [FILLER_SLOT; MAX_FIELDS];
        for (s, a) in slots.iter_mut().zip(atoms) {
            match Slot::of(*a) {
                Some(x) => *s = x,
                None => return Tuple(Repr::Boxed(atoms.into())),
            }
        }
        Tuple(Repr::Inline {
            slots,
            len: atoms.len() as u8,
        })
    }

    pub fn len(&self) -> usize {
        match &self.0 {
            Repr::Inline { len, .. } => usize::from(*len),
            Repr::Boxed(a) => a.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn atoms(&self) -> Atoms {
        let mut atoms = [FILLER; MAX_FIELDS];
        match &self.0 {
            Repr::Inline { slots, len } => {
                for (a, s) in atoms.iter_mut().zip(&slots[..usize::from(*len)]) {
                    *a = s.atom();
                }
            }
            Repr::Boxed(b) => atoms[..b.len()].copy_from_slice(b),
        }
        Atoms {
            atoms,
            len: self.len() as u8,
        }
    }

    pub fn write(&self, out: &mut String) {
        for (i, a) in self.atoms().iter().enumerate() {
            if i > 0 {
                out.push_str(" . ");
            }
            a.write(out);
        }
    }
}

/// The order of `(atoms padded with FILLER to MAX_FIELDS, len)`: that of the former
/// inline `[Atom; MAX_FIELDS]` representation, which decides the order elements are
/// listed in (rendered text, netlink batches). Slots order like their atoms, so two
/// inline tuples compare without decoding.
impl Ord for Tuple {
    fn cmp(&self, other: &Tuple) -> std::cmp::Ordering {
        match (&self.0, &other.0) {
            (Repr::Inline { slots: a, len: m }, Repr::Inline { slots: b, len: n }) => {
                (a, m).cmp(&(b, n))
            }
            _ => {
                let (a, b) = (self.atoms(), other.atoms());
                (a.atoms, a.len).cmp(&(b.atoms, b.len))
            }
        }
    }
}

impl PartialOrd for Tuple {
    fn partial_cmp(&self, other: &Tuple) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl std::fmt::Debug for Tuple {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.atoms().iter()).finish()
    }
}

impl std::fmt::Display for Tuple {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut s = String::new();
        self.write(&mut s);
        f.write_str(&s)
    }
}
