fn main() {
    println!("{}", lb_user::EBPF_OBJECT.len());
}
