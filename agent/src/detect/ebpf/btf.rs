//! Struct member offsets from the kernel's BTF, for the exec hook's argv read
//! (a hand-done CO-RE: aya-ebpf programs cannot carry field relocations).
//! One linear pass over the type section: a general BTF library's full
//! parse of vmlinux alone would break the start-up budget
//! (docs/development.md).
use anyhow::{bail, ensure, Context, Result};

const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_TYPEDEF: u32 = 8;
const KIND_VOLATILE: u32 = 9;
const KIND_CONST: u32 = 10;
const KIND_RESTRICT: u32 = 11;
const KIND_TYPE_TAG: u32 = 18;

pub(super) struct Btf<'a> {
    types: &'a [u8],
    strings: &'a [u8],
    /// Byte offset in `types` of each type id (id 0 is void).
    offsets: Vec<u32>,
}

fn u32_at(b: &[u8], off: usize) -> Result<u32> {
    let bytes = b.get(off..off + 4).context("BTF truncated")?;
    Ok(u32::from_le_bytes(bytes.try_into().unwrap()))
}

impl<'a> Btf<'a> {
    pub(super) fn parse(data: &'a [u8]) -> Result<Self> {
        ensure!(
            data.len() >= 24 && data[..2] == [0x9f, 0xeb],
            "not little-endian BTF"
        );
        let hdr_len = u32_at(data, 4)? as usize;
        let (type_off, type_len) = (u32_at(data, 8)? as usize, u32_at(data, 12)? as usize);
        let (str_off, str_len) = (u32_at(data, 16)? as usize, u32_at(data, 20)? as usize);
        let types = data
            .get(hdr_len + type_off..hdr_len + type_off + type_len)
            .context("BTF types out of range")?;
        let strings = data
            .get(hdr_len + str_off..hdr_len + str_off + str_len)
            .context("BTF strings out of range")?;
        let mut offsets = vec![0];
        let mut off = 0;
        while off < types.len() {
            offsets.push(off as u32);
            let info = u32_at(types, off + 4)?;
            let vlen = (info & 0xffff) as usize;
            let extra = match (info >> 24) & 0x1f {
                1 | 14 | 17 => 4,             // int, var, decl_tag
                3 => 12,                      // array
                4 | 5 | 15 | 19 => 12 * vlen, // struct, union, datasec, enum64
                6 | 13 => 8 * vlen,           // enum, func_proto
                _ => 0,
            };
            off += 12 + extra;
        }
        Ok(Btf {
            types,
            strings,
            offsets,
        })
    }

    fn name(&self, name_off: u32) -> &'a [u8] {
        let s = self.strings.get(name_off as usize..).unwrap_or_default();
        &s[..s.iter().position(|&b| b == 0).unwrap_or(s.len())]
    }

    /// (kind, name offset, vlen, size_or_type, byte offset of trailing data)
    fn header(&self, id: u32) -> Result<(u32, u32, usize, u32, usize)> {
        let off = *self.offsets.get(id as usize).context("bad BTF type id")? as usize;
        let info = u32_at(self.types, off + 4)?;
        Ok((
            (info >> 24) & 0x1f,
            u32_at(self.types, off)?,
            (info & 0xffff) as usize,
            u32_at(self.types, off + 8)?,
            off + 12,
        ))
    }

    /// Byte offset of `field` in struct `name`, looking into anonymous
    /// struct/union members (as mm_struct's fields now sit in one).
    pub(super) fn member_offset(&self, name: &str, field: &str) -> Result<u64> {
        for id in 1..self.offsets.len() as u32 {
            let (kind, name_off, vlen, _, _) = self.header(id)?;
            if kind == KIND_STRUCT && vlen > 0 && self.name(name_off) == name.as_bytes() {
                if let Some(bits) = self.find(id, field.as_bytes())? {
                    return Ok(bits / 8);
                }
            }
        }
        bail!("no {name}.{field} in the kernel's BTF")
    }

    fn find(&self, id: u32, field: &[u8]) -> Result<Option<u64>> {
        let (kind, _, vlen, _, data) = self.header(id)?;
        let kind_flag = u32_at(self.types, data - 8)? >> 31 == 1;
        ensure!(kind == KIND_STRUCT || kind == KIND_UNION, "not a struct");
        for i in 0..vlen {
            let m = data + 12 * i;
            let (m_name, m_type, m_off) = (
                u32_at(self.types, m)?,
                u32_at(self.types, m + 4)?,
                u32_at(self.types, m + 8)?,
            );
            let bits = if kind_flag { m_off & 0xff_ffff } else { m_off } as u64;
            let name = self.name(m_name);
            if name == field {
                return Ok(Some(bits));
            }
            if name.is_empty() {
                let inner = self.strip(m_type)?;
                let (k, ..) = self.header(inner)?;
                if k == KIND_STRUCT || k == KIND_UNION {
                    if let Some(off) = self.find(inner, field)? {
                        return Ok(Some(bits + off));
                    }
                }
            }
        }
        Ok(None)
    }

    /// Follows typedef/const/volatile/restrict/type_tag to the real type.
    fn strip(&self, mut id: u32) -> Result<u32> {
        for _ in 0..32 {
            let (kind, _, _, next, _) = self.header(id)?;
            match kind {
                KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | KIND_TYPE_TAG => {
                    id = next;
                }
                _ => return Ok(id),
            }
        }
        bail!("BTF type chain too long")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_argv_fields_in_this_kernel() {
        let Ok(data) = std::fs::read("/sys/kernel/btf/vmlinux") else {
            println!("SKIPPED: no /sys/kernel/btf/vmlinux on this kernel");
            return;
        };
        let btf = Btf::parse(&data).unwrap();
        let mm = btf.member_offset("task_struct", "mm").unwrap();
        let start = btf.member_offset("mm_struct", "arg_start").unwrap();
        let end = btf.member_offset("mm_struct", "arg_end").unwrap();
        assert!(mm > 0 && mm.is_multiple_of(8), "task_struct.mm at {mm}");
        assert_eq!(end, start + 8, "arg_end follows arg_start in mm_struct");
        assert!(btf.member_offset("task_struct", "no_such_field").is_err());
        // The exec's binary and its AT_SECURE (`agent-ebpf/src/exec.rs`).
        assert_eq!(btf.member_offset("qstr", "name").unwrap(), 8);
        for (st, field) in [
            ("mm_struct", "exe_file"),
            ("mm_struct", "saved_auxv"),
            ("file", "f_path"),
            ("path", "dentry"),
            ("dentry", "d_name"),
        ] {
            let off = btf.member_offset(st, field).unwrap();
            assert!(off.is_multiple_of(8), "{st}.{field} at {off}");
        }
    }

    #[test]
    fn rejects_garbage() {
        assert!(Btf::parse(b"not btf at all, not even close").is_err());
        assert!(Btf::parse(&[
            0x9f, 0xeb, 1, 0, 24, 0, 0, 0, 0, 0, 0, 0, 255, 255, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
        ])
        .is_err());
    }
}
