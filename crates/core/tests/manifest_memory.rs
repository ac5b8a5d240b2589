//! A JSON List of items without `kind`, as `kubectl get -o json` prints a List
//! (items before kind), was buffered whole waiting for the List's kind: 20 MB of items
//! took 358 MB, 100 MB aborted on a failed allocation. The reader holds the text plus
//! one item, whatever the items contain; this measures the heap while it reads 100 MB
//! of such items (a counting allocator: this file is its own test binary, so no other
//! test allocates meanwhile).

#[path = "../benches/support/memory.rs"]
#[allow(dead_code)]
mod memory;

use kproxy_core::manifest;

#[test]
fn a_100_mb_json_list_of_kindless_items_is_read_in_bounded_memory() {
    const SIZE: usize = 100 << 20;
    let item = |i: usize| {
        format!(
            r#"{{"metadata":{{"name":"svc-{i:08}","namespace":"default","labels":{{"app":"web"}}}},"spec":{{"ports":[{{"port":80}}]}}}}"#
        )
    };
    let mut text = String::with_capacity(SIZE + 1024);
    text.push_str(r#"{"apiVersion":"v1","items":["#);
    let mut n = 0;
    while text.len() < SIZE {
        if n > 0 {
            text.push(',');
        }
        text.push_str(&item(n));
        // Kind-less empty objects too: the shape of the report.
        text.push_str(",{}");
        n += 2;
    }
    text.push_str(r#"],"kind":"List","metadata":{"resourceVersion":""}}"#);

    memory::reset_peak();
    let base = memory::live();
    let (mut objects, mut errors, mut last) = (0usize, 0usize, None);
    manifest::for_each_object("big.json", text.as_bytes(), &mut |r| match r {
        Ok(_) => objects += 1,
        Err(e) => {
            errors += 1;
            last = Some(e);
        }
    });
    let grew = memory::peak() - base;
    eprintln!(
        "{} MiB of List items: peak heap {:.2} MiB above the text",
        text.len() >> 20,
        memory::mib(grew)
    );
    assert_eq!(objects, 0);
    // The first problems one by one, then one count of the rest.
    assert_eq!(errors, manifest::MAX_ERRORS_PER_FILE + 1);
    let last = last.unwrap();
    assert!(
        last.reason
            .contains("more documents or List items not read"),
        "{last}"
    );
    assert!(
        grew < 16 << 20,
        "reading {} MiB of List items took {:.1} MiB of heap",
        text.len() >> 20,
        memory::mib(grew)
    );
}
