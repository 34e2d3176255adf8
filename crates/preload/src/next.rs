//! The program's own allocator: the next definitions of the malloc family after this library
//! (glibc's, or a jemalloc/tcmalloc the program links), resolved once with `dlsym(RTLD_NEXT)`.
//! Blocks below the size threshold go there, so a program keeps its allocator for everything
//! memtide does not manage. While the symbols are being resolved (dlsym itself may allocate),
//! allocations come from a small static bootstrap area that is never freed. Entry points:
//! [`next`], [`bootstrap_alloc`].

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};

use libc::{c_char, c_int, c_void, size_t};

pub struct Next {
    pub malloc: unsafe extern "C" fn(size_t) -> *mut c_void,
    pub free: unsafe extern "C" fn(*mut c_void),
    pub calloc: unsafe extern "C" fn(size_t, size_t) -> *mut c_void,
    pub realloc: unsafe extern "C" fn(*mut c_void, size_t) -> *mut c_void,
    pub posix_memalign: unsafe extern "C" fn(*mut *mut c_void, size_t, size_t) -> c_int,
    pub usable_size: unsafe extern "C" fn(*mut c_void) -> size_t,
}

static NEXT: AtomicPtr<Next> = AtomicPtr::new(std::ptr::null_mut());
static RESOLVING: AtomicBool = AtomicBool::new(false);

fn sym(name: &[u8]) -> usize {
    // SAFETY: NUL-terminated name; RTLD_NEXT from a shared object.
    unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr() as *const c_char) as usize }
}

/// The program's allocator, or `None` while it is being resolved (use the bootstrap area).
pub fn next() -> Option<&'static Next> {
    let p = NEXT.load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: set once to a leaked Next, never freed.
        return Some(unsafe { &*p });
    }
    if RESOLVING.swap(true, Ordering::AcqRel) {
        return None;
    }
    let f = [
        sym(b"malloc\0"),
        sym(b"free\0"),
        sym(b"calloc\0"),
        sym(b"realloc\0"),
        sym(b"posix_memalign\0"),
        sym(b"malloc_usable_size\0"),
    ];
    if f.contains(&0) {
        memtide_engine::say::fatal_line(b"memtide: fatal: cannot find the program's malloc\n");
        // SAFETY: aborting.
        unsafe { libc::abort() }
    }
    // SAFETY: each address is the next definition of the function of that signature.
    let next = unsafe {
        Next {
            malloc: std::mem::transmute::<usize, unsafe extern "C" fn(size_t) -> *mut c_void>(f[0]),
            free: std::mem::transmute::<usize, unsafe extern "C" fn(*mut c_void)>(f[1]),
            calloc: std::mem::transmute::<usize, unsafe extern "C" fn(size_t, size_t) -> *mut c_void>(
                f[2],
            ),
            realloc: std::mem::transmute::<
                usize,
                unsafe extern "C" fn(*mut c_void, size_t) -> *mut c_void,
            >(f[3]),
            posix_memalign: std::mem::transmute::<
                usize,
                unsafe extern "C" fn(*mut *mut c_void, size_t, size_t) -> c_int,
            >(f[4]),
            usable_size: std::mem::transmute::<usize, unsafe extern "C" fn(*mut c_void) -> size_t>(
                f[5],
            ),
        }
    };
    // Allocated from the bootstrap area: Box would go through Rust's allocator, which is
    // glibc's and fine, but keep this path free of anything that could recurse.
    let slot = bootstrap_alloc(std::mem::size_of::<Next>(), 16) as *mut Next;
    assert!(!slot.is_null(), "bootstrap area exhausted");
    // SAFETY: a fresh, aligned, large enough slot.
    unsafe { slot.write(next) };
    NEXT.store(slot, Ordering::Release);
    RESOLVING.store(false, Ordering::Release);
    // SAFETY: just stored.
    Some(unsafe { &*slot })
}

const BOOT: usize = 256 * 1024;

#[repr(C, align(4096))]
struct Area([u8; BOOT]);

static mut AREA: Area = Area([0; BOOT]);
static USED: AtomicUsize = AtomicUsize::new(0);

fn area() -> usize {
    std::ptr::addr_of_mut!(AREA) as usize
}

/// Bump-allocates zeroed bytes from the static area, with the length in a 16-byte header.
pub fn bootstrap_alloc(n: usize, align: usize) -> *mut c_void {
    let align = align.clamp(16, 4096);
    loop {
        let used = USED.load(Ordering::Acquire);
        let start = (area() + used + 16).next_multiple_of(align);
        let end = start + n;
        if end > area() + BOOT {
            return std::ptr::null_mut();
        }
        if USED
            .compare_exchange(used, end - area(), Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            // SAFETY: the header lies inside the area, before `start`, and is ours.
            unsafe { ((start - 16) as *mut usize).write(n) };
            return start as *mut c_void;
        }
    }
}

pub fn is_bootstrap(p: *const c_void) -> bool {
    (p as usize).wrapping_sub(area()) < BOOT
}

pub fn bootstrap_len(p: *const c_void) -> usize {
    // SAFETY: p came from bootstrap_alloc, which wrote its length just before it.
    unsafe { ((p as usize - 16) as *const usize).read() }
}
