//! End to end: programs memtide cannot manage are told why, precisely, and still run right:
//! a Go program (its runtime maps memory with raw system calls) and a statically linked C
//! program (the preload library cannot load into it).

mod common;

use std::process::Command;
use std::time::Duration;

use common::{memtide, output_within, require, stderr, Scratch};

fn run_under_memtide(s: &Scratch, exe: &std::path::Path) -> std::process::Output {
    output_within(
        memtide()
            .args(["run", "--dram", "64MiB", "--tier"])
            .arg(s.path())
            .arg("--")
            .arg(exe),
        Duration::from_secs(120),
    )
}

#[test]
fn a_go_program_is_told_its_runtime_maps_memory_itself() {
    require("go");
    let s = Scratch::new("go");
    std::fs::write(
        s.path().join("main.go"),
        r#"package main

import "fmt"

func main() {
	b := make([]byte, 256<<20)
	for i := range b {
		b[i] = byte(i * 7)
	}
	sum := 0
	for i := 0; i < len(b); i += 4096 {
		sum += int(b[i])
	}
	fmt.Println("sum", sum)
}
"#,
    )
    .unwrap();
    let exe = s.path().join("fill");
    let b = Command::new("go")
        .args(["build", "-o"])
        .arg(&exe)
        .arg("main.go")
        .current_dir(s.path())
        .env("GOCACHE", s.path().join("cache"))
        .env("GOPATH", s.path().join("gopath"))
        .env("GO111MODULE", "off")
        .output()
        .unwrap();
    assert!(b.status.success(), "go build: {}", stderr(&b));
    let o = run_under_memtide(&s, &exe);
    assert!(o.status.success(), "{}", stderr(&o));
    // Every 4096th byte is byte(i*7) with i a multiple of 4096: 0.
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "sum 0");
    let err = stderr(&o);
    assert!(
        err.contains("it is a Go program: the Go runtime maps its memory with raw system calls"),
        "{err}"
    );
    assert!(!err.contains("size threshold"), "{err}");
}

#[test]
fn a_static_program_is_told_the_library_cannot_load() {
    require("gcc");
    let s = Scratch::new("static");
    std::fs::write(
        s.path().join("fill.c"),
        "#include <stdio.h>\n#include <stdlib.h>\n\
         int main(void) { size_t n = 256u << 20; unsigned char *b = malloc(n);\n\
         for (size_t i = 0; i < n; i++) b[i] = (unsigned char)(i % 251);\n\
         unsigned long s = 0; for (size_t i = 0; i < n; i += 4096) s += b[i];\n\
         printf(\"sum %lu\\n\", s); return 0; }\n",
    )
    .unwrap();
    let exe = s.path().join("fill");
    let b = Command::new("gcc")
        .args(["-O1", "-static", "-o"])
        .arg(&exe)
        .arg(s.path().join("fill.c"))
        .output()
        .unwrap();
    assert!(b.status.success(), "gcc: {}", stderr(&b));
    let native = Command::new(&exe).output().unwrap();
    let o = run_under_memtide(&s, &exe);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(o.stdout, native.stdout);
    let err = stderr(&o);
    assert!(
        err.contains("it is statically linked: memtide's preload library cannot load into it"),
        "{err}"
    );
}
