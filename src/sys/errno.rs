//! What an `errno` means to the layers above: they ask these questions of an
//! [`std::io::Error`] instead of naming libc's error numbers.

use std::io;

/// Whether `e` says the process or the system ran out of descriptors or of memory for one
/// (`EMFILE`, `ENFILE`, `ENOBUFS`, `ENOMEM`): a moment's shortage (an accept flood), not a
/// broken socket, so a listener polls again instead of failing.
pub fn is_out_of_descriptors(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_shortages_and_nothing_else() {
        for n in [libc::EMFILE, libc::ENFILE, libc::ENOBUFS, libc::ENOMEM] {
            assert!(is_out_of_descriptors(&io::Error::from_raw_os_error(n)), "{n}");
        }
        assert!(!is_out_of_descriptors(&io::Error::from_raw_os_error(libc::ECONNRESET)));
        assert!(!is_out_of_descriptors(&io::Error::from(io::ErrorKind::WouldBlock)));
    }
}
