//! `Reader`: reads the msgpack subset the wire uses, strict about types. It
//! checks every declared length against the bytes left before allocating, and
//! names the field it was reading in every error.

use super::error::{WireError, WireResult};

/// The msgpack type a marker byte starts, for error messages.
pub fn describe(marker: u8) -> &'static str {
    match marker {
        0x00..=0x7f | 0xcc..=0xcf | 0xd0..=0xd3 | 0xe0..=0xff => "int",
        0x80..=0x8f | 0xde | 0xdf => "map",
        0x90..=0x9f | 0xdc | 0xdd => "array",
        0xa0..=0xbf | 0xd9..=0xdb => "str",
        0xc0 => "nil",
        0xc1 => "the reserved byte",
        0xc2 | 0xc3 => "bool",
        0xc4..=0xc6 => "bin",
        0xc7..=0xc9 | 0xd4..=0xd8 => "ext",
        0xca => "float32",
        0xcb => "float64",
    }
}

/// Reads msgpack values from a frame body, never past its end.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

#[cold]
fn wrong_type(path: &str, expected: &str, marker: u8) -> WireError {
    WireError::malformed(
        path,
        format!(
            "expected {expected}, found {} ({marker:#04x})",
            describe(marker)
        ),
    )
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, pos: 0 }
    }

    /// Bytes not read yet.
    #[inline]
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    #[inline]
    pub fn take(&mut self, n: usize, path: &str) -> WireResult<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.truncated(n as u64, path));
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    #[cold]
    fn truncated(&self, needed: u64, path: &str) -> WireError {
        WireError::Truncated {
            path: path.to_string(),
            needed,
            left: self.remaining(),
        }
    }

    #[inline]
    fn array<const N: usize>(&mut self, path: &str) -> WireResult<[u8; N]> {
        let bytes = self.take(N, path)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    #[inline]
    fn marker(&mut self, path: &str) -> WireResult<u8> {
        Ok(self.array::<1>(path)?[0])
    }

    /// Consumes a nil if one is next; `Option` fields are nil or the value.
    #[inline]
    pub fn try_nil(&mut self) -> bool {
        if self.buf.get(self.pos) == Some(&0xc0) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    /// Reads a length of `width` big-endian bytes and checks that `n *
    /// min_item_bytes` bytes are left, so an absurd declared length fails here
    /// instead of in an allocation.
    fn length(&mut self, width: usize, min_item_bytes: u64, path: &str) -> WireResult<usize> {
        let n = match width {
            1 => self.array::<1>(path)?[0] as u64,
            2 => u16::from_be_bytes(self.array::<2>(path)?) as u64,
            _ => u32::from_be_bytes(self.array::<4>(path)?) as u64,
        };
        let needed = n.saturating_mul(min_item_bytes);
        if needed > self.remaining() as u64 {
            return Err(self.truncated(needed, path));
        }
        Ok(n as usize)
    }

    pub fn array_len(&mut self, path: &str) -> WireResult<usize> {
        match self.marker(path)? {
            m @ 0x90..=0x9f => {
                let n = (m & 0x0f) as usize;
                if n > self.remaining() {
                    return Err(self.truncated(n as u64, path));
                }
                Ok(n)
            }
            0xdc => self.length(2, 1, path),
            0xdd => self.length(4, 1, path),
            m => Err(wrong_type(path, "array", m)),
        }
    }

    /// An `Option` field: nil, or what `read` reads.
    #[inline]
    pub fn opt<T>(
        &mut self,
        read: impl FnOnce(&mut Self) -> WireResult<T>,
    ) -> WireResult<Option<T>> {
        if self.try_nil() {
            Ok(None)
        } else {
            read(self).map(Some)
        }
    }

    /// Reads an array header that must hold exactly `n` fields.
    #[inline]
    pub fn expect_array(&mut self, n: usize, path: &str) -> WireResult<()> {
        let got = self.array_len(path)?;
        if got != n {
            return Err(WireError::malformed(
                path,
                format!("expected an array of {n} fields, found {got}"),
            ));
        }
        Ok(())
    }

    pub fn map_len(&mut self, path: &str) -> WireResult<usize> {
        match self.marker(path)? {
            m @ 0x80..=0x8f => {
                let n = (m & 0x0f) as usize;
                if 2 * n > self.remaining() {
                    return Err(self.truncated(2 * n as u64, path));
                }
                Ok(n)
            }
            0xde => self.length(2, 2, path),
            0xdf => self.length(4, 2, path),
            m => Err(wrong_type(path, "map", m)),
        }
    }

    /// Any msgpack integer, widened so that every encoding fits.
    pub fn integer(&mut self, path: &str) -> WireResult<i128> {
        let m = self.marker(path)?;
        Ok(match m {
            0x00..=0x7f => m as i128,
            0xe0..=0xff => m as i8 as i128,
            0xcc => self.array::<1>(path)?[0] as i128,
            0xcd => u16::from_be_bytes(self.array(path)?) as i128,
            0xce => u32::from_be_bytes(self.array(path)?) as i128,
            0xcf => u64::from_be_bytes(self.array(path)?) as i128,
            0xd0 => self.array::<1>(path)?[0] as i8 as i128,
            0xd1 => i16::from_be_bytes(self.array(path)?) as i128,
            0xd2 => i32::from_be_bytes(self.array(path)?) as i128,
            0xd3 => i64::from_be_bytes(self.array(path)?) as i128,
            _ => return Err(wrong_type(path, "int", m)),
        })
    }

    #[inline]
    fn ranged<T: TryFrom<i128>>(&mut self, path: &str, range: &str) -> WireResult<T> {
        // Fast path: a positive fixint is the common case for small fields.
        let v = match self.buf.get(self.pos) {
            Some(&m) if m < 0x80 => {
                self.pos += 1;
                m as i128
            }
            _ => self.integer(path)?,
        };
        T::try_from(v).map_err(|_| out_of_range(path, v, range))
    }

    #[inline]
    pub fn u64(&mut self, path: &str) -> WireResult<u64> {
        self.ranged(path, "0..2^64")
    }

    #[inline]
    pub fn u32(&mut self, path: &str) -> WireResult<u32> {
        self.ranged(path, "0..2^32")
    }

    #[inline]
    pub fn i32(&mut self, path: &str) -> WireResult<i32> {
        self.ranged(path, "-2^31..2^31")
    }

    #[inline]
    pub fn u8(&mut self, path: &str) -> WireResult<u8> {
        self.ranged(path, "0..256")
    }

    pub fn bool(&mut self, path: &str) -> WireResult<bool> {
        match self.marker(path)? {
            0xc2 => Ok(false),
            0xc3 => Ok(true),
            m => Err(wrong_type(path, "bool", m)),
        }
    }

    #[inline]
    pub fn f32(&mut self, path: &str) -> WireResult<f32> {
        match self.marker(path)? {
            0xca => Ok(f32::from_bits(u32::from_be_bytes(self.array(path)?))),
            m => Err(wrong_type(path, "float32", m)),
        }
    }

    #[inline]
    pub fn f64(&mut self, path: &str) -> WireResult<f64> {
        match self.marker(path)? {
            0xcb => Ok(f64::from_bits(u64::from_be_bytes(self.array(path)?))),
            m => Err(wrong_type(path, "float64", m)),
        }
    }

    /// The length of a `str` whose marker `m` was just read.
    fn str_len(&mut self, m: u8, path: &str) -> WireResult<Option<usize>> {
        Ok(Some(match m {
            0xa0..=0xbf => (m & 0x1f) as usize,
            0xd9 => self.length(1, 1, path)?,
            0xda => self.length(2, 1, path)?,
            0xdb => self.length(4, 1, path)?,
            _ => return Ok(None),
        }))
    }

    pub fn str(&mut self, path: &str) -> WireResult<&'a str> {
        let m = self.marker(path)?;
        match self.str_len(m, path)? {
            Some(n) => self.str_body(n, path),
            None => Err(wrong_type(path, "str", m)),
        }
    }

    fn str_body(&mut self, n: usize, path: &str) -> WireResult<&'a str> {
        let bytes = self.take(n, path)?;
        std::str::from_utf8(bytes)
            .map_err(|e| WireError::malformed(path, format!("str is not valid UTF-8 ({e})")))
    }

    fn bin_len(&mut self, m: u8, path: &str) -> WireResult<Option<usize>> {
        Ok(Some(match m {
            0xc4 => self.length(1, 1, path)?,
            0xc5 => self.length(2, 1, path)?,
            0xc6 => self.length(4, 1, path)?,
            _ => return Ok(None),
        }))
    }

    pub fn bin(&mut self, path: &str) -> WireResult<&'a [u8]> {
        let m = self.marker(path)?;
        match self.bin_len(m, path)? {
            Some(n) => self.take(n, path),
            None => Err(wrong_type(path, "bin", m)),
        }
    }

    /// `bin` of 4-byte little-endian items; its length must be a multiple of 4.
    #[inline]
    pub fn words(&mut self, path: &str) -> WireResult<&'a [u8]> {
        let bytes = self.bin(path)?;
        if bytes.len() % 4 != 0 {
            return Err(WireError::malformed(
                path,
                format!(
                    "array of 4-byte items has {} bytes, not a multiple of 4",
                    bytes.len()
                ),
            ));
        }
        Ok(bytes)
    }

    #[inline]
    pub fn u32s(&mut self, path: &str) -> WireResult<Vec<u32>> {
        Ok(self
            .words(path)?
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    pub fn f32s(&mut self, path: &str) -> WireResult<Vec<f32>> {
        Ok(self
            .words(path)?
            .chunks_exact(4)
            .map(|c| f32::from_bits(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect())
    }

    /// Reads one dynamic value's marker and hands back what it starts; used by
    /// `value::read_value`.
    pub(super) fn next_marker(&mut self, path: &str) -> WireResult<u8> {
        self.marker(path)
    }

    pub(super) fn str_after_marker(&mut self, m: u8, path: &str) -> WireResult<Option<&'a str>> {
        match self.str_len(m, path)? {
            Some(n) => self.str_body(n, path).map(Some),
            None => Ok(None),
        }
    }

    pub(super) fn bin_after_marker(&mut self, m: u8, path: &str) -> WireResult<Option<&'a [u8]>> {
        match self.bin_len(m, path)? {
            Some(n) => self.take(n, path).map(Some),
            None => Ok(None),
        }
    }

    /// Steps back over a marker just read, so a typed reader can re-read it.
    pub(super) fn unread_marker(&mut self) {
        self.pos -= 1;
    }
}

#[cold]
fn out_of_range(path: &str, v: i128, range: &str) -> WireError {
    WireError::malformed(path, format!("int {v} out of range {range}"))
}
