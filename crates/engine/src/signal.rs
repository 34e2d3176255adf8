//! The SIGBUS handler that runs the fault path in the faulting thread, and the bookkeeping that
//! keeps the program's own SIGBUS handler working behind it. Entry points: [`install`],
//! [`register`] (an engine makes its memory known as a [`FaultHandler`]),
//! [`set_program_handler`].
//!
//! Used when faults are delivered as SIGBUS (`Delivery::Signal`; the default is handler
//! threads, see `engine/handlers.rs`). With userfaultfd's SIGBUS feature a fault on a missing
//! managed page raises SIGBUS in the thread that touched it, which resolves it there without a
//! context switch; but a fault the kernel takes on the program's behalf fails with EFAULT.
//! Faults outside managed memory go to whatever handler the program installed (its
//! `sigaction` calls for SIGBUS are redirected here by the preload library), or get the
//! default action.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicUsize, Ordering};
use std::sync::Once;

/// What the fault path did with an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Resolved: the page was mapped by this call (which woke anyone waiting on it); retry the
    /// access.
    Handled,
    /// The page was already there (another thread mapped it meanwhile): retry the access
    /// (threads waiting on it must be woken by whoever served the fault).
    Raced,
    /// Not managed memory (or memory the program freed): the program's own fault.
    NotManaged,
}

/// Memory whose missing-page faults the SIGBUS handler resolves. Both methods run in a signal
/// handler: no locks, no allocation.
pub trait FaultHandler: Sync {
    /// Whether `addr` lies in this handler's memory.
    fn contains(&self, addr: usize) -> bool;
    /// Resolves a fault at `addr`.
    fn handle_fault(&self, addr: usize) -> Fault;
}

const MAX_HANDLERS: usize = 8;

/// Registered handlers: each points at a leaked `&'static dyn FaultHandler`.
static HANDLERS: [AtomicPtr<&'static dyn FaultHandler>; MAX_HANDLERS] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; MAX_HANDLERS];

/// The handler that was installed before ours (used until the program installs its own).
static PREV_HANDLER: AtomicUsize = AtomicUsize::new(libc::SIG_DFL);
static PREV_FLAGS: AtomicI32 = AtomicI32::new(0);
/// The program's own SIGBUS handler, as it asked for it through `sigaction`.
static APP_SET: AtomicBool = AtomicBool::new(false);
static APP_HANDLER: AtomicUsize = AtomicUsize::new(libc::SIG_DFL);
static APP_FLAGS: AtomicI32 = AtomicI32::new(0);

static INSTALL: Once = Once::new();
static INSTALL_ERR: AtomicI32 = AtomicI32::new(0);

type SigactionFn = unsafe extern "C" fn(i32, *const libc::sigaction, *mut libc::sigaction) -> i32;

/// libc's own `sigaction` (the next definition after ours, so that a preloaded interposer of
/// `sigaction` is bypassed).
fn real_sigaction() -> SigactionFn {
    static REAL: AtomicUsize = AtomicUsize::new(0);
    let mut f = REAL.load(Ordering::Acquire);
    if f == 0 {
        // SAFETY: dlsym with a NUL-terminated name; RTLD_NEXT is valid from a shared object or
        // an executable.
        f = unsafe { libc::dlsym(libc::RTLD_NEXT, c"sigaction".as_ptr()) } as usize;
        if f == 0 {
            f = libc::sigaction as *const () as usize;
        }
        REAL.store(f, Ordering::Release);
    }
    // SAFETY: `f` is the address of a function with sigaction's signature.
    unsafe { std::mem::transmute::<usize, SigactionFn>(f) }
}

/// Installs the SIGBUS handler (once per process).
pub fn install() -> io::Result<()> {
    INSTALL.call_once(|| {
        // SAFETY: sigaction is plain data; all-zero is a valid starting value.
        let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        act.sa_sigaction = on_sigbus as *const () as usize;
        // NODEFER: a program handler we chain to may itself fault on managed memory.
        act.sa_flags = libc::SA_SIGINFO | libc::SA_NODEFER | libc::SA_ONSTACK | libc::SA_RESTART;
        // SAFETY: act.sa_mask is a valid sigset_t. Block every asynchronous signal while
        // the fault is served, so that no program signal handler runs on this thread while it
        // holds a page busy.
        unsafe {
            libc::sigfillset(&mut act.sa_mask);
            libc::sigdelset(&mut act.sa_mask, libc::SIGBUS);
            libc::sigdelset(&mut act.sa_mask, libc::SIGSEGV);
        }
        // SAFETY: valid pointers to sigaction structs.
        if unsafe { real_sigaction()(libc::SIGBUS, &act, &mut old) } != 0 {
            INSTALL_ERR.store(
                io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EINVAL),
                Ordering::Release,
            );
            return;
        }
        PREV_HANDLER.store(old.sa_sigaction, Ordering::Release);
        PREV_FLAGS.store(old.sa_flags, Ordering::Release);
    });
    match INSTALL_ERR.load(Ordering::Acquire) {
        0 => Ok(()),
        e => Err(io::Error::from_raw_os_error(e)),
    }
}

/// Makes `handler`'s memory visible to the SIGBUS handler (for the life of the process).
pub fn register(handler: &'static dyn FaultHandler) {
    let ptr: *mut &'static dyn FaultHandler = Box::leak(Box::new(handler));
    for slot in &HANDLERS {
        if slot
            .compare_exchange(
                std::ptr::null_mut(),
                ptr,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
        {
            return;
        }
    }
    panic!("more than {MAX_HANDLERS} memtide engines in one process");
}

/// The handler whose memory holds `addr`, if any.
fn handler_for(addr: usize) -> Option<&'static dyn FaultHandler> {
    for slot in &HANDLERS {
        let p = slot.load(Ordering::Acquire);
        if p.is_null() {
            return None;
        }
        // SAFETY: registered handlers are leaked ('static) and never unregistered.
        let e = unsafe { *p };
        if e.contains(addr) {
            return Some(e);
        }
    }
    None
}

/// Records the program's SIGBUS disposition (for a `sigaction(SIGBUS, ...)` call the preload
/// library intercepted) and reports the previous one in `old`.
pub fn set_program_handler(act: Option<&libc::sigaction>, old: Option<&mut libc::sigaction>) {
    if let Some(old) = old {
        // SAFETY: sigaction is plain data.
        *old = unsafe { std::mem::zeroed() };
        if APP_SET.load(Ordering::Acquire) {
            old.sa_sigaction = APP_HANDLER.load(Ordering::Acquire);
            old.sa_flags = APP_FLAGS.load(Ordering::Acquire);
        } else {
            old.sa_sigaction = PREV_HANDLER.load(Ordering::Acquire);
            old.sa_flags = PREV_FLAGS.load(Ordering::Acquire);
        }
    }
    if let Some(act) = act {
        APP_HANDLER.store(act.sa_sigaction, Ordering::Release);
        APP_FLAGS.store(act.sa_flags, Ordering::Release);
        APP_SET.store(true, Ordering::Release);
    }
}

extern "C" fn on_sigbus(sig: i32, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: errno is thread-local and always valid; the kernel passes a valid siginfo.
    let (errno, addr) = unsafe { (*libc::__errno_location(), (*info).si_addr() as usize) };
    if let Some(e) = handler_for(addr) {
        if e.handle_fault(addr) != Fault::NotManaged {
            // SAFETY: restoring the interrupted code's errno.
            unsafe { *libc::__errno_location() = errno };
            return;
        }
    }
    chain(sig, info, ctx);
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

/// Passes a SIGBUS that is not ours to the program's handler, or applies the default action.
fn chain(sig: i32, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let (h, flags) = if APP_SET.load(Ordering::Acquire) {
        (
            APP_HANDLER.load(Ordering::Acquire),
            APP_FLAGS.load(Ordering::Acquire),
        )
    } else {
        (
            PREV_HANDLER.load(Ordering::Acquire),
            PREV_FLAGS.load(Ordering::Acquire),
        )
    };
    if h == libc::SIG_DFL || h == libc::SIG_IGN {
        // A SIGBUS that cannot be ignored: restore the default action and raise it again.
        // SAFETY: plain data and system calls.
        unsafe {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            real_sigaction()(libc::SIGBUS, &dfl, std::ptr::null_mut());
            libc::raise(libc::SIGBUS);
        }
        return;
    }
    if flags & libc::SA_SIGINFO != 0 {
        // SAFETY: the program registered this as an SA_SIGINFO handler.
        let f: extern "C" fn(i32, *mut libc::siginfo_t, *mut libc::c_void) =
            unsafe { std::mem::transmute(h) };
        f(sig, info, ctx);
    } else {
        // SAFETY: the program registered this as a plain handler.
        let f: extern "C" fn(i32) = unsafe { std::mem::transmute(h) };
        f(sig);
    }
}
