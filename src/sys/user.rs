//! Who this process runs as.

/// The effective user id of this process (`geteuid(2)`): the owner of the files it creates and
/// the user whose permissions it has.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn owns_the_files_it_creates() {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let p = std::env::temp_dir().join(format!("toroid-euid-{}-{nanos}", std::process::id()));
        std::fs::write(&p, b"").unwrap();
        let owner = std::fs::metadata(&p).unwrap().uid();
        std::fs::remove_file(&p).unwrap();
        assert_eq!(super::euid(), owner);
    }
}
