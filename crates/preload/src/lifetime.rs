//! A process ends when its last program thread ends, as without memtide. glibc ends a process
//! when its last thread exits (`exit(0)`, from the thread that ends it), and it counts the
//! engine's threads too: without this, a program whose last thread leaves by returning from
//! its start routine or by `pthread_exit` (a child forked from a thread other than the main
//! one, once that thread's function returns; a main thread that calls `pthread_exit` and
//! leaves the work to others) would live on with only memtide's threads, and its parent would
//! wait for it for good. So every thread's start routine runs inside [`trampoline`], and
//! `pthread_exit` is wrapped: a program thread that ends when no other program thread is left
//! ends the process with `exit(0)`, as glibc would have. (Its own thread-specific data
//! destructors do not run then; the process's `atexit` handlers do.)

use libc::{c_int, c_void, pthread_attr_t, pthread_t};

use crate::engine;

/// A thread's start routine. "C-unwind": `pthread_exit` and cancellation unwind through it
/// (and through [`trampoline`]), which a plain "C" function would refuse.
type StartRoutine = extern "C-unwind" fn(*mut c_void) -> *mut c_void;

struct Start {
    f: StartRoutine,
    arg: *mut c_void,
}

extern "C-unwind" fn trampoline(p: *mut c_void) -> *mut c_void {
    // SAFETY: `p` is the Start that pthread_create boxed for this thread.
    let Start { f, arg } = *unsafe { Box::from_raw(p as *mut Start) };
    memtide_engine::threads::note_program_thread();
    let r = f(arg);
    memtide_engine::threads::forget_program_thread();
    end_if_last();
    r
}

/// Ends the process (`exit(0)`) when the calling thread is the program's last and the
/// engine's threads are all that would be left.
fn end_if_last() {
    let Some(e) = engine() else {
        return;
    };
    if e.in_child() || !last_program_thread() {
        return;
    }
    // SAFETY: ending the process as glibc does when its last thread exits.
    unsafe { libc::exit(0) }
}

/// Whether no thread of this process but the caller is the program's: the others are
/// memtide's (named `memtide-…`), io_uring's workers (`iou-…`), or ended (a main thread that
/// called `pthread_exit` stays listed, a zombie, until the process ends).
fn last_program_thread() -> bool {
    // SAFETY: gettid has no preconditions.
    let me = unsafe { libc::syscall(libc::SYS_gettid) } as u32;
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return false;
    };
    for t in tasks.flatten() {
        let Ok(tid) = t.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if tid == me {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")) else {
            continue; // ended meanwhile
        };
        let Some((comm, rest)) = stat.split_once(" (").and_then(|(_, r)| r.rsplit_once(") "))
        else {
            return false;
        };
        if rest.starts_with('Z') || rest.starts_with('X') {
            continue;
        }
        if !(comm.starts_with("memtide-") || comm.starts_with("iou-")) {
            return false;
        }
    }
    true
}

/// Starts the thread in [`trampoline`], which ends the process after the program's last
/// thread as glibc would.
///
/// # Safety
///
/// As pthread_create(3).
#[no_mangle]
pub unsafe extern "C" fn pthread_create(
    thread: *mut pthread_t,
    attr: *const pthread_attr_t,
    f: StartRoutine,
    arg: *mut c_void,
) -> c_int {
    let real = real!(
        "pthread_create",
        unsafe extern "C" fn(
            *mut pthread_t,
            *const pthread_attr_t,
            StartRoutine,
            *mut c_void,
        ) -> c_int
    );
    let s = Box::into_raw(Box::new(Start { f, arg }));
    // SAFETY: forwarding the caller's arguments, with our start routine and its box.
    let rc = unsafe { real(thread, attr, trampoline, s as *mut c_void) };
    if rc != 0 {
        // SAFETY: the thread was not created: the box is still ours.
        drop(unsafe { Box::from_raw(s) });
    }
    rc
}

/// Ends the process instead when the calling thread is the program's last.
///
/// # Safety
///
/// As pthread_exit(3).
#[no_mangle]
pub unsafe extern "C" fn pthread_exit(retval: *mut c_void) -> ! {
    memtide_engine::threads::forget_program_thread();
    end_if_last();
    let real = real!("pthread_exit", unsafe extern "C" fn(*mut c_void) -> !);
    // SAFETY: forwarding.
    unsafe { real(retval) }
}
