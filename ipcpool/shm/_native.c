/* The hand-off's hot calls on shared memory in C, each following a layout described in Python
 * field for field: the name directory's (``shm.directory``: a reader's lookup and state check, the
 * broker's write of a new entry), the request ring's (``shm.requests``: a writer's frame put) and
 * the seal board's (``shm.sealboard``: a seal's event recorded, then its word posted); and the
 * broker's read of a create frame (``frames``) and its check of the usual create up to its entry
 * (``broker.objects.ObjectTable.create_usual``), each a stand-in for Python it is tested against.
 *
 * A reader's get runs the first two first, often on a CPU its sleep left with cold caches; the
 * broker's create writes the entry the reader waits for; a writer's create and seal put their
 * frames, and the seal posts the word readers watch, on a CPU as cold: in Python each is dozens
 * of bytecodes and objects touched; here one call.
 * Built where a compiler is (the package works the same without it: ``directory.py`` falls back).
 * Limited API (abi3): one build serves every Python from 3.11.
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <dlfcn.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline void cpu_relax(void) {   /* a spin on a line another CPU writes */
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

#define ENTRY 512
#define NAME_AT 224
#define MAX_NAME 255
#define CHANGE_AT 16   /* the header's change count */
#define DTYPE_AT 128
#define SHAPE_AT 160
#define MAX_DIMS 8
#define NO_WORD 0xFFFFFFFFu
#define EMPTY 0
#define WRITING 1
#define SEALED 2
#define GONE 3
#define HAS_USER_META 1
#define HAS_SHAPE 2
#define IN_ARENA 4
#define KEPT_EVENT 8
#define STATE_SPINS 100000   /* reads of an entry being written before ``state`` gives up */

static uint32_t crc_table[256];

static void crc_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[n] = c;
    }
}

static uint32_t crc32_of(const unsigned char *p, Py_ssize_t n) {   /* as zlib.crc32 */
    uint32_t c = 0xFFFFFFFFu;
    while (n--)
        c = crc_table[(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

/* The version word: read with acquire order, and the entry's other loads stay between its two
 * reads (x86 keeps loads in order; the fences stop the compiler moving them). */
static inline uint64_t ver_of(const unsigned char *at) {
    return __atomic_load_n((const uint64_t *)at, __ATOMIC_ACQUIRE);
}

static inline uint64_t u64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint32_t u32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint16_t u16(const unsigned char *p) { uint16_t v; memcpy(&v, p, 2); return v; }

static int is_zero(const unsigned char *p, size_t n) {
    while (n--)
        if (*p++)
            return 0;
    return 1;
}

/* The hot calls take their arguments as a vector (METH_FASTCALL), each read as the letter of a
 * PyArg_ParseTuple format would read it, and build their answers item by item: a format's parse
 * cost ~2.5 µs a call on a CPU a sleep left cold (2-CPU host, eleven arguments), this ~1. */
/* A map pinned once (``Pinned(map, writable=False)``): its buffer taken when it is made and held until
 * ``release()`` (or its end), so a hot call reads the address from the object instead of asking the
 * map for its buffer each time (an mmap's buffer export, on a CPU back from sleep, is ~1.5 µs of
 * cold code). The map cannot be closed while one is held; its owner releases it first. */
typedef struct {
    PyObject_HEAD
    Py_buffer view;
} Pinned;

static PyObject *pinned_type;

static PyObject *pinned_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *map;
    int writable = 0;
    static char *kw[] = {"map", "writable", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|p", kw, &map, &writable))
        return NULL;
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    Pinned *self = (Pinned *)alloc(type, 0);
    if (self == NULL)
        return NULL;
    if (PyObject_GetBuffer(map, &self->view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
        self->view.obj = NULL;
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static PyObject *pinned_release(PyObject *self, PyObject *Py_UNUSED(unused)) {
    Pinned *p = (Pinned *)self;
    if (p->view.obj != NULL)
        PyBuffer_Release(&p->view);
    p->view.obj = NULL;
    p->view.buf = NULL;
    Py_RETURN_NONE;
}

static void pinned_dealloc(PyObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    Pinned *p = (Pinned *)self;
    if (p->view.obj != NULL)
        PyBuffer_Release(&p->view);
    freefunc free_ = (freefunc)PyType_GetSlot(type, Py_tp_free);
    free_(self);
    Py_DECREF(type);
}

static PyMethodDef pinned_methods[] = {
    {"release", pinned_release, METH_NOARGS, "release(): the map's buffer given back (the map may close); later calls raise"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot pinned_slots[] = {
    {Py_tp_new, pinned_new},
    {Py_tp_dealloc, pinned_dealloc},
    {Py_tp_methods, pinned_methods},
    {Py_tp_doc, "Pinned(map, writable=False): a map's buffer held for the hot calls (release() before the map closes)"},
    {0, NULL},
};

static PyType_Spec pinned_spec = {"ipcpool.shm._native.Pinned", sizeof(Pinned), 0, Py_TPFLAGS_DEFAULT, pinned_slots};

/* ``obj``'s buffer: a Pinned's as held (nothing taken: ``put_buffer`` then gives nothing back),
 * else ``PyObject_GetBuffer``'s. */
static int get_buffer(PyObject *obj, Py_buffer *view, int flags) {
    if ((PyObject *)Py_TYPE(obj) != pinned_type)
        return PyObject_GetBuffer(obj, view, flags);
    Pinned *p = (Pinned *)obj;
    if (p->view.obj == NULL) {
        PyErr_SetString(PyExc_ValueError, "a pinned map used after its release");
        return -1;
    }
    if ((flags & PyBUF_WRITABLE) && p->view.readonly) {
        PyErr_SetString(PyExc_BufferError, "a map pinned read-only");
        return -1;
    }
    *view = p->view;
    view->obj = NULL;
    return 0;
}

static void put_buffer(Py_buffer *view) {
    if (view->obj != NULL)
        PyBuffer_Release(view);
}

static int args_are(Py_ssize_t nargs, Py_ssize_t want, const char *fn) {
    if (nargs == want)
        return 1;
    PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd arguments (%zd given)", fn, want, nargs);
    return 0;
}

static int as_n(PyObject *o, Py_ssize_t *v) {   /* "n" */
    if (PyLong_Check(o)) {
        *v = PyLong_AsSsize_t(o);
    } else {
        PyObject *i = PyNumber_Index(o);
        if (i == NULL)
            return 0;
        *v = PyLong_AsSsize_t(i);
        Py_DECREF(i);
    }
    return !(*v == -1 && PyErr_Occurred());
}

static int as_K(PyObject *o, unsigned long long *v) {   /* "K" */
    *v = PyLong_AsUnsignedLongLongMask(o);
    return !(*v == (unsigned long long)-1 && PyErr_Occurred());
}

static int as_y(PyObject *o, const char **s, Py_ssize_t *n) {   /* "y#", of bytes */
    char *b;
    if (!PyBytes_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "a bytes object is required");
        return 0;
    }
    if (PyBytes_AsStringAndSize(o, &b, n) < 0)
        return 0;
    *s = b;
    return 1;
}

static int is_a(PyObject *o, PyTypeObject *type, const char *what) {   /* "O!" */
    if (PyObject_TypeCheck(o, type))
        return 1;
    PyErr_Format(PyExc_TypeError, "%s is required", what);
    return 0;
}

/* A tuple of the ``n`` new references in ``items`` (taken over); NULL, with all of them released,
 * where one is NULL (its error set) or the tuple cannot be made. */
static PyObject *tuple_of(Py_ssize_t n, PyObject **items) {
    PyObject *t = NULL;
    for (Py_ssize_t k = 0; k < n; k++)
        if (items[k] == NULL)
            goto failed;
    t = PyTuple_New(n);
    if (t == NULL)
        goto failed;
    for (Py_ssize_t k = 0; k < n; k++)
        PyTuple_SetItem(t, k, items[k]);   /* (steals it; cannot fail on a new tuple in range) */
    return t;
failed:
    for (Py_ssize_t k = 0; k < n; k++)
        Py_XDECREF(items[k]);
    return NULL;
}

static PyObject *bool_of(int v) { return Py_NewRef(v ? Py_True : Py_False); }

/* The Entry's fields, in ``directory.Entry``'s order, from a copy of one entry. */
static PyObject *entry_tuple(Py_ssize_t index, const unsigned char *e) {
    uint32_t word = u32(e + 48);
    unsigned ndim = e[52], dtype_len = e[53];
    uint16_t flags = u16(e + 54);
    PyObject *event, *dtype, *shape;
    event = is_zero(e + 64, 64) ? PyBytes_FromStringAndSize(NULL, 0)
                                : PyBytes_FromStringAndSize((const char *)e + 64, 64);
    if (event == NULL)
        return NULL;
    if (dtype_len) {
        dtype = PyUnicode_DecodeUTF8((const char *)e + DTYPE_AT, dtype_len > 32 ? 32 : dtype_len, NULL);
        if (dtype == NULL) {
            Py_DECREF(event);
            return NULL;
        }
    } else {
        dtype = Py_NewRef(Py_None);
    }
    if (flags & HAS_SHAPE && ndim <= MAX_DIMS) {
        shape = PyTuple_New(ndim);
        for (unsigned k = 0; shape != NULL && k < ndim; k++) {
            PyObject *dim = PyLong_FromUnsignedLongLong(u64(e + SHAPE_AT + 8 * k));
            if (dim == NULL || PyTuple_SetItem(shape, k, dim) < 0)
                Py_CLEAR(shape);
        }
        if (shape == NULL) {
            Py_DECREF(event);
            Py_DECREF(dtype);
            return NULL;
        }
    } else {
        shape = Py_NewRef(Py_None);
    }
    PyObject *items[14] = {
        PyLong_FromSsize_t(index), PyLong_FromUnsignedLongLong(u64(e + 8)), PyLong_FromUnsignedLong(u32(e + 16)),
        PyLong_FromUnsignedLongLong(u64(e + 24)), PyLong_FromUnsignedLongLong(u64(e + 32)),
        PyLong_FromUnsignedLongLong(u64(e + 40)), word == NO_WORD ? Py_NewRef(Py_None) : PyLong_FromUnsignedLong(word),
        PyLong_FromUnsignedLongLong(u64(e + 56)), event, dtype, shape, bool_of(flags & HAS_USER_META),
        bool_of(flags & IN_ARENA), bool_of(flags & KEPT_EVENT)};
    return tuple_of(14, items);
}

/* ``map``'s buffer (``flags``: PyBUF_SIMPLE or PyBUF_WRITABLE), checked to hold ``capacity``
 * entries after its header; -1 with the error set where it cannot. */
static int map_of(PyObject *map, Py_ssize_t capacity, int flags, Py_buffer *view) {
    if (get_buffer(map, view, flags) < 0)
        return -1;
    if (capacity <= 0 || (capacity + 1) * (Py_ssize_t)ENTRY > view->len) {
        put_buffer(view);
        PyErr_SetString(PyExc_ValueError, "a directory's capacity beyond its map");
        return -1;
    }
    return 0;
}

/* The live entry (WRITING or SEALED) of ``name`` in the directory at ``base``: 1, its head, dtype,
 * shape and name copied whole into ``copy`` and its index in ``*index``; 0 where there is none, or
 * where an entry on the probe was being written for all of torn_us. */
static int find_entry(const unsigned char *base, Py_ssize_t capacity, Py_ssize_t probes, const unsigned char *name,
                      Py_ssize_t n, Py_ssize_t torn_us, unsigned char *copy, Py_ssize_t *index_out) {
    if (n > MAX_NAME)   /* longer than any entry's name: none holds it */
        return 0;
    Py_ssize_t index = (Py_ssize_t)(crc32_of(name, n) % (uint32_t)capacity);
    Py_ssize_t torn = 0;
    uint64_t give_up = 0;
    while (probes > 0) {
        const unsigned char *at = base + (index + 1) * ENTRY;
        uint64_t ver = ver_of(at);
        if (!(ver & 1)) {
            memcpy(copy, at, DTYPE_AT);   /* the head: its other lines only for the name looked for */
            uint32_t state = u32(copy + 16), name_len = u32(copy + 20);
            int candidate = name_len == (uint32_t)n && (state == WRITING || state == SEALED);
            if (candidate)
                memcpy(copy + DTYPE_AT, at + DTYPE_AT, NAME_AT - DTYPE_AT + n);
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (ver_of(at) == ver) {   /* a whole copy: decided on it alone */
                if (state == EMPTY)
                    return 0;
                if (candidate && memcmp(copy + NAME_AT, name, n) == 0) {
                    *index_out = index;
                    return 1;
                }
                probes--;   /* another name's entry, or a gone one: the next on the probe */
                index = index + 1 < capacity ? index + 1 : 0;
                continue;
            }
        }
        if ((++torn & 63) == 0) {   /* being written: this entry again, for torn_us at most */
            if (give_up == 0)
                give_up = now_ns() + (uint64_t)torn_us * 1000;
            else if (now_ns() >= give_up)
                return 0;
        }
        cpu_relax();
    }
    return 0;
}

/* The live entry of ``name`` in a directory (``dir``: its map, capacity, probes and the name, as
 * lookup and take are given them; ``torn``: torn_us): 1 found (its copy and index; ``view``
 * held), 0 none (nothing held), -1 an error (set). */
static int entry_of(PyObject *const *dir, PyObject *torn, Py_buffer *view, unsigned char *copy, Py_ssize_t *index) {
    const char *name;
    Py_ssize_t n, capacity, probes, torn_us;
    if (!as_n(dir[1], &capacity) || !as_n(dir[2], &probes) || !as_y(dir[3], &name, &n) || !as_n(torn, &torn_us)
            || map_of(dir[0], capacity, PyBUF_SIMPLE, view) < 0)
        return -1;
    if (find_entry(view->buf, capacity, probes, (const unsigned char *)name, n, torn_us, copy, index))
        return 1;
    put_buffer(view);
    return 0;
}

/* lookup(map, capacity, probes, name: bytes, torn_us) -> the entry's fields, or None. An entry
 * being written is read again until it is whole, for torn_us at most (then None). */
static PyObject *lookup(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer view;
    unsigned char copy[ENTRY];
    Py_ssize_t index;
    int found = args_are(nargs, 5, "lookup") ? entry_of(args, args[4], &view, copy, &index) : -1;
    if (found <= 0)
        return found < 0 ? NULL : Py_NewRef(Py_None);
    put_buffer(&view);
    return entry_tuple(index, copy);
}

/* The state of the entry at ``at`` while it holds object ``gen`` (else GONE) into ``*state``: 1;
 * 0 where it was being written for all of STATE_SPINS reads. */
static int entry_state(const unsigned char *at, uint64_t gen, uint32_t *state) {
    for (long k = 0; k < STATE_SPINS; k++) {
        uint64_t ver = ver_of(at);
        if (ver & 1)
            continue;
        uint64_t g = u64(at + 8);
        uint32_t s = u32(at + 16);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (ver_of(at) == ver) {
            *state = g == gen ? s : GONE;
            return 1;
        }
    }
    return 0;
}

/* state(map, index, gen) -> the entry's state while it holds object gen, else GONE; None where
 * it was being written for all of STATE_SPINS reads */
static PyObject *state(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    PyObject *map;
    Py_ssize_t index;
    unsigned long long gen;
    if (!args_are(nargs, 3, "state") || !as_n(args[1], &index) || !as_K(args[2], &gen))
        return NULL;
    map = args[0];
    Py_buffer view;
    if (get_buffer(map, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (index < 0 || (index + 2) * (Py_ssize_t)ENTRY > view.len) {
        put_buffer(&view);
        PyErr_SetString(PyExc_IndexError, "no such directory entry");
        return NULL;
    }
    uint32_t s;
    int whole = entry_state((const unsigned char *)view.buf + (index + 1) * ENTRY, gen, &s);
    put_buffer(&view);
    if (!whole)   /* a writer mid-write this long (or dead there): the caller waits, interruptibly */
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLong(s);
}

/* A session's lease page (``shm.leases``): a count word, then SLOTS slots of SLOT bytes from HEAD,
 * each (pool | entry << 32, gen, nonce) as words. */
#define LEASE_SLOTS 120
#define LEASE_SLOT 32
#define LEASE_HEAD 64

/* The driver's cuEventRecord and cuEventQuery, from the libcuda this process has loaded already
 * (cuda.bindings loads it); NULL where none is loaded. */
typedef int (*event_record_fn)(void *event, void *stream);
typedef int (*event_query_fn)(void *event);
static event_record_fn event_record;
static event_query_fn event_query_call;

static void *driver_call(const char *name) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    return lib == NULL ? NULL : dlsym(lib, name);
}

static event_record_fn driver_event_record(void) {
    if (event_record == NULL)
        event_record = (event_record_fn)driver_call("cuEventRecord");
    return event_record;
}

static event_query_fn driver_event_query(void) {
    if (event_query_call == NULL)
        event_query_call = (event_query_fn)driver_call("cuEventQuery");
    return event_query_call;
}

/* event_query(event) -> a CUresult (0: complete, 600: not yet), or -1 where no driver is loaded
 * here. ``event``: a CUevent, as an int. A reader's check that the seal's event (a credit it
 * keeps open) completed: one call where the bindings' is several on a cold CPU. */
static PyObject *event_query(PyObject *Py_UNUSED(self), PyObject *arg) {
    unsigned long long event = PyLong_AsUnsignedLongLong(arg);
    if (event == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    event_query_fn query = driver_event_query();
    return PyLong_FromLong(query == NULL ? -1 : query((void *)(uintptr_t)event));
}

/* The key of where the entry copied at ``e`` lies and how it is typed, written at ``key`` (room for
 * 27 + 32 + 8 * MAX_DIMS bytes), as ``directory.where_key`` builds it: its arena, offset and size,
 * then its ndim (0 without a shape), dtype length, whether it has a shape, its dtype and dims.
 * Its length, or -1 where the entry's type is none a lease made ahead could have. */
#define WHERE_KEY_MAX (27 + 32 + 8 * MAX_DIMS)
static Py_ssize_t where_key_of(const unsigned char *e, unsigned char *key) {
    unsigned ndim = e[52], dtype_len = e[53];
    int has_shape = (u16(e + 54) & HAS_SHAPE) != 0;
    if (dtype_len > 32 || (has_shape && ndim > MAX_DIMS))
        return -1;
    Py_ssize_t dims = has_shape ? 8 * (Py_ssize_t)ndim : 0;
    memcpy(key, e + 24, 24);
    key[24] = (unsigned char)(has_shape ? ndim : 0);
    key[25] = (unsigned char)dtype_len;
    key[26] = (unsigned char)has_shape;
    memcpy(key + 27, e + DTYPE_AT, dtype_len);
    memcpy(key + 27 + dtype_len, e + SHAPE_AT, dims);
    return 27 + (Py_ssize_t)dtype_len + dims;
}

/* Whether the seal of the entry copied at ``e`` is done on the GPU: 1 where it has no event (host
 * memory), or where its event is a credit (KEPT_EVENT) open in ``credits`` and the driver's query
 * says complete; else 0 (the caller orders after it its own way). ``credits``: the client's
 * credit table (``backend/cuda/credits.py``: rows of a 64-byte handle and its CUevent, at the
 * handle's ``row_of``), read in place under the GIL that its writes hold too. Never an error. */
#define CREDIT_ROW 72

/* A 64-byte handle's row of ``rows``, as ``credits.row_of``: its eight words mixed by
 * multiplication (no table to fetch on a cold CPU, as crc32 has). */
static Py_ssize_t credit_row_of(const unsigned char *handle, Py_ssize_t rows) {
    uint64_t h = 0;
    for (int k = 0; k < 8; k++)
        h = (h ^ u64(handle + 8 * k)) * 0x9E3779B97F4A7C15ull;
    return (Py_ssize_t)((h >> 32) % (uint64_t)rows);
}

/* credit_row(handle, rows): ``credit_row_of``, for the tests that hold it to the Python's. */
static PyObject *credit_row(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    const char *handle;
    Py_ssize_t n, rows;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "credit_row(handle, rows)");
        return NULL;
    }
    if (!as_y(args[0], &handle, &n) || !as_n(args[1], &rows))
        return NULL;
    if (n != 64 || rows <= 0) {
        PyErr_SetString(PyExc_ValueError, "a 64-byte handle and rows > 0");
        return NULL;
    }
    return PyLong_FromSsize_t(credit_row_of((const unsigned char *)handle, rows));
}

static int seal_done(const unsigned char *e, PyObject *credits) {
    if (is_zero(e + 64, 64))
        return 1;
    if (!(u16(e + 54) & KEPT_EVENT) || !PyByteArray_Check(credits))
        return 0;
    Py_ssize_t rows = PyByteArray_Size(credits) / CREDIT_ROW;
    const unsigned char *table = (const unsigned char *)PyByteArray_AsString(credits);
    if (rows <= 0 || table == NULL)
        return 0;
    const unsigned char *row = table + credit_row_of(e + 64, rows) * CREDIT_ROW;
    if (memcmp(row, e + 64, 64) != 0)   /* not open here, or another credit holds its row */
        return 0;
    uint64_t event = u64(row + 64);
    event_query_fn query = driver_event_query();
    return query != NULL && event != 0 && query((void *)(uintptr_t)event) == 0;
}

/* What ``made`` (a dict of ``where_key`` -> anything) holds for where the entry copied at ``e``
 * lies, taken out of it (a new reference), where its seal is done (``seal_done`` on ``credits``);
 * else NULL, never an error: the caller then answers as without it. */
static PyObject *take_made(const unsigned char *e, PyObject *made, PyObject *credits) {
    unsigned char key[WHERE_KEY_MAX];
    Py_ssize_t n = where_key_of(e, key);
    if (n < 0 || PyDict_Size(made) <= 0)
        return NULL;
    PyObject *k = PyBytes_FromStringAndSize((const char *)key, n), *got = NULL;
    if (k != NULL && (got = PyDict_GetItemWithError(made, k)) != NULL && seal_done(e, credits)) {
        Py_INCREF(got);
        if (PyDict_DelItem(made, k) < 0)
            Py_CLEAR(got);
    } else {
        got = NULL;
    }
    Py_XDECREF(k);
    PyErr_Clear();   /* (no memory for the key, say: the entry comes as without a lease made ahead) */
    return got;
}

/* take(page, free, nonces, torn_us, map, capacity, probes, name, pool, arenas, sealed_only[, made,
 * credits]) -> None, (fields, slot, nonce, state) or (None, slot, nonce, index, gen, made's).
 * A reader's get from a directory in one call: the entry of ``name`` looked up (``lookup``), a
 * hazard slot of the lease page taken for it (the last of ``free``, numbered one more than the
 * count in ``nonces``, a bytearray of 8 that keeps it: ``ClientLeasePage.take``), then its state
 * read again (``state``); the page's four come first, bound once (``ClientLeasePage.take_in_c``).
 * No slot (slot None, state -1) where the caller's own way must decide: an entry the broker
 * serves (metadata, not in an arena), an arena not in ``arenas`` (not imported yet), an object not
 * sealed where ``sealed_only``, every slot in use. State None: the entry was being written all
 * that while (the caller reads it again). ``made``: None, or the reader's leases made ahead by
 * where they lie (a dict keyed by ``directory.where_key``): an object sealed where one of them
 * lies, whose seal is done (``seal_done``, on ``credits``), comes as (None, slot, nonce, index,
 * gen, what ``made`` held), taken out of ``made``, nothing more to read or wait for (none of the
 * entry's fields made into objects). No fence between the hazard and the check: the broker's
 * barrier orders them on this CPU (``shm.fence``); the compiler keeps their order. */
static PyObject *take(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t pool;
    unsigned long long nonce;
    int sealed_only;
    PyObject *made = NULL;
    if (nargs != 11 && nargs != 13) {
        PyErr_Format(PyExc_TypeError, "take() takes 11 or 13 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!is_a(args[1], &PyList_Type, "a list") || !is_a(args[2], &PyByteArray_Type, "a bytearray")
            || !as_n(args[8], &pool) || !is_a(args[9], &PyDict_Type, "a dict")
            || (sealed_only = PyObject_IsTrue(args[10])) < 0
            || (nargs == 13 && args[11] != Py_None && !is_a(args[11], &PyDict_Type, "a dict")))
        return NULL;
    if (nargs == 13 && args[11] != Py_None)
        made = args[11];
    PyObject *page = args[0], *free_list = args[1], *nonces = args[2], *arenas = args[9];
    PyObject *credits = nargs == 13 ? args[12] : Py_None;
    if (PyByteArray_Size(nonces) != 8) {
        PyErr_SetString(PyExc_ValueError, "take's nonce count is a bytearray of 8");
        return NULL;
    }
    memcpy(&nonce, PyByteArray_AsString(nonces), 8);
    Py_buffer dv;
    unsigned char copy[ENTRY];
    Py_ssize_t index;
    int found = entry_of(args + 4, args[3], &dv, copy, &index);
    if (found <= 0)
        return found < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *out = NULL;
    uint16_t flags = u16(copy + 54);
    uint64_t gen = u64(copy + 8);
    int usual = (flags & IN_ARENA) && !(flags & HAS_USER_META) && (!sealed_only || u32(copy + 16) == SEALED)
                && PyList_Size(free_list) > 0 && pool >= 0 && pool <= 0xFFFFFFFF;
    if (usual) {
        PyObject *alloc = PyLong_FromUnsignedLongLong(u64(copy + 24));
        int has = alloc == NULL ? -1 : PyDict_Contains(arenas, alloc);
        Py_XDECREF(alloc);
        if (has < 0)
            goto done;
        usual = has;
    }
    if (!usual) {
        PyObject *items[4] = {entry_tuple(index, copy), Py_NewRef(Py_None), PyLong_FromUnsignedLongLong(nonce),
                              PyLong_FromLong(-1)};
        out = tuple_of(4, items);
        goto done;
    }
    Py_buffer pv;
    if (get_buffer(page, &pv, PyBUF_WRITABLE) < 0)
        goto done;
    Py_ssize_t last = PyList_Size(free_list) - 1;
    Py_ssize_t slot = PyLong_AsSsize_t(PyList_GetItem(free_list, last));
    if (pv.len < LEASE_HEAD + LEASE_SLOTS * LEASE_SLOT || slot < 0 || slot >= LEASE_SLOTS) {
        put_buffer(&pv);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "a lease page or free slot out of place");
        goto done;
    }
    if (PySequence_DelItem(free_list, last) < 0) {
        put_buffer(&pv);
        goto done;
    }
    nonce += 1;
    memcpy(PyByteArray_AsString(nonces), &nonce, 8);
    uint64_t *words = pv.buf, *at = words + (LEASE_HEAD + slot * LEASE_SLOT) / 8;
    /* As the Python's: the count first, the nonce last (the broker reads the nonce first). */
    __atomic_store_n(words, (uint64_t)(LEASE_SLOTS - last), __ATOMIC_RELEASE);
    __atomic_store_n(at, (uint64_t)pool | (uint64_t)index << 32, __ATOMIC_RELEASE);
    __atomic_store_n(at + 1, gen, __ATOMIC_RELEASE);
    __atomic_store_n(at + 2, (uint64_t)nonce, __ATOMIC_RELEASE);
    put_buffer(&pv);
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    uint32_t st;
    int whole = entry_state((const unsigned char *)dv.buf + (index + 1) * ENTRY, gen, &st);
    PyObject *ahead = made != NULL && whole && st == SEALED && u32(copy + 16) == SEALED
                      ? take_made(copy, made, credits) : NULL;
    if (ahead != NULL) {
        PyObject *items[6] = {Py_NewRef(Py_None), PyLong_FromSsize_t(slot), PyLong_FromUnsignedLongLong(nonce),
                              PyLong_FromSsize_t(index), PyLong_FromUnsignedLongLong(gen), ahead};
        out = tuple_of(6, items);
        goto done;
    }
    PyObject *items[4] = {entry_tuple(index, copy), PyLong_FromSsize_t(slot), PyLong_FromUnsignedLongLong(nonce),
                          whole ? PyLong_FromUnsignedLong(st) : Py_NewRef(Py_None)};
    out = tuple_of(4, items);
done:
    put_buffer(&dv);
    return out;
}

/* The write of a new entry into the directory at ``base`` (its fields checked to fit): the first
 * entry on the name's probe that holds no live object (empty or gone), its version made odd, the
 * whole body written (zeros past each field, as the Python's struct), the version even, the
 * change count bumped. Its index, or -1 where the probe found no free entry. */
static Py_ssize_t publish_into(unsigned char *base, Py_ssize_t capacity, Py_ssize_t probes, const unsigned char *name,
                               Py_ssize_t n, uint64_t gen, uint32_t state, uint64_t alloc, uint64_t offset,
                               uint64_t size, uint32_t word, uint64_t seq, const unsigned char *event,
                               Py_ssize_t event_len, const unsigned char *dtype, Py_ssize_t dtype_len,
                               const unsigned char *dims, Py_ssize_t dims_len, unsigned ndim, unsigned flags) {
    Py_ssize_t index = (Py_ssize_t)(crc32_of(name, n) % (uint32_t)capacity);
    if (probes > capacity)
        probes = capacity;
    Py_ssize_t k = 0;
    for (; k < probes; k++) {   /* (the broker's own entries: no version to check) */
        uint32_t st = u32(base + (index + 1) * ENTRY + 16);
        if (st != WRITING && st != SEALED)
            break;
        index = index + 1 < capacity ? index + 1 : 0;
    }
    if (k == probes)
        return -1;
    unsigned char body[NAME_AT + MAX_NAME - 8];   /* everything after the version */
    memset(body, 0, sizeof body);
#define F(off) (body + (off) - 8)   /* a field of the body by its offset in the entry */
    uint32_t name_len = (uint32_t)n;
    uint16_t fl = (uint16_t)flags;
    memcpy(F(8), &gen, 8);
    memcpy(F(16), &state, 4);
    memcpy(F(20), &name_len, 4);
    memcpy(F(24), &alloc, 8);
    memcpy(F(32), &offset, 8);
    memcpy(F(40), &size, 8);
    memcpy(F(48), &word, 4);
    *F(52) = (uint8_t)ndim;
    *F(53) = (uint8_t)dtype_len;
    memcpy(F(54), &fl, 2);
    memcpy(F(56), &seq, 8);
    if (event_len)
        memcpy(F(64), event, event_len);
    if (dtype_len)
        memcpy(F(DTYPE_AT), dtype, dtype_len);
    if (dims_len)
        memcpy(F(SHAPE_AT), dims, dims_len);
    memcpy(F(NAME_AT), name, n);
#undef F
    unsigned char *at = base + (index + 1) * ENTRY;
    uint64_t *ver = (uint64_t *)at, v = __atomic_load_n(ver, __ATOMIC_RELAXED);
    __atomic_store_n(ver, v + 1, __ATOMIC_RELAXED);   /* odd: readers skip it while it changes */
    __atomic_thread_fence(__ATOMIC_RELEASE);
    memcpy(at + 8, body, sizeof body);
    __atomic_store_n(ver, v + 2, __ATOMIC_RELEASE);   /* even: whole */
    uint64_t *change = (uint64_t *)(base + CHANGE_AT);
    __atomic_store_n(change, __atomic_load_n(change, __ATOMIC_RELAXED) + 1, __ATOMIC_RELEASE);
    return index;
}

/* publish(map, capacity, probes, name, gen, state, alloc, offset, size, word, seq, event, dtype,
 *         dims, ndim, flags) -> the index written, or None (no free entry on the name's probe).
 * The broker's write of a new entry (``Directory.publish``, the single writer): ``publish_into``.
 * ``dims``: the shape packed (ndim u64s); ``word`` NO_WORD for none. */
static PyObject *publish(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *map;
    const char *name, *event, *dtype, *dims;
    Py_ssize_t capacity, probes, n, event_len, dtype_len, dims_len;
    unsigned long long gen, alloc, offset, size, seq;
    unsigned int state, word, ndim, flags;
    if (!PyArg_ParseTuple(args, "Onny#KIKKKIKy#y#y#II", &map, &capacity, &probes, &name, &n, &gen, &state,
                          &alloc, &offset, &size, &word, &seq, &event, &event_len, &dtype, &dtype_len, &dims,
                          &dims_len, &ndim, &flags))
        return NULL;
    if (n > MAX_NAME || event_len > 64 || dtype_len > 32 || dims_len > 8 * MAX_DIMS || ndim > 255
            || flags > 0xFFFF) {
        PyErr_SetString(PyExc_ValueError, "an entry's field longer than its place");
        return NULL;
    }
    Py_buffer view;
    if (map_of(map, capacity, PyBUF_WRITABLE, &view) < 0)
        return NULL;
    Py_ssize_t index = publish_into(view.buf, capacity, probes, (const unsigned char *)name, n, gen, state, alloc,
                                    offset, size, word, seq, (const unsigned char *)event, event_len,
                                    (const unsigned char *)dtype, dtype_len, (const unsigned char *)dims, dims_len,
                                    ndim, flags);
    put_buffer(&view);
    if (index < 0)
        Py_RETURN_NONE;
    return PyLong_FromSsize_t(index);
}

/* The request ring (``shm.requests``): where it lies in the session's page, its words and slots. */
#define RING_SLOTS_AT 128
#define RING_SLOT 512
#define RING_MAX_FRAME (RING_SLOT - 4)
#define RING_MARGIN_NS 20000u
#define AWAKE_AT 64   /* the directory header's word: the broker polls the rings until then */
#define ID_AT 12      /* a frame's request id (``frames``) */

static Py_ssize_t ring_at(void) { return (Py_ssize_t)sysconf(_SC_PAGESIZE); }   /* mmap.PAGESIZE */
static Py_ssize_t ring_slots(void) { return (2 * ring_at() - RING_SLOTS_AT) / RING_SLOT; }

/* A frame built ahead with an empty name (``frames.create``/``seal``), completed with ``rid`` and
 * ``name`` (appended, its length at ``name_len_at``) and written to the session's ring in ``page``,
 * as ``RingWriter.put`` does, where the broker's ``directory`` says it polls long enough
 * (``Channel.send_frame``'s rule). 1: put; 2: put, but the broker's polling may have ended
 * meanwhile (send a nudge); 0: not put (the ring is full, the broker sleeps, or the frame does not
 * fit: send it on the socket); -1: an error set (a map too short, not a buffer). */
static int ring_write(PyObject *page, PyObject *directory, const char *frame, Py_ssize_t flen, Py_ssize_t name_len_at,
                      unsigned long long rid, const char *name, Py_ssize_t name_len) {
    if (name_len_at < 0 || name_len_at + 2 > ID_AT || flen < ID_AT + 8 || flen + name_len > RING_MAX_FRAME)
        return 0;
    Py_buffer dir, view;
    if (get_buffer(directory, &dir, PyBUF_SIMPLE) < 0)
        return -1;
    if (dir.len < AWAKE_AT + 8) {
        put_buffer(&dir);
        PyErr_SetString(PyExc_ValueError, "a directory map shorter than its header");
        return -1;
    }
    const uint64_t *awake = (const uint64_t *)((const unsigned char *)dir.buf + AWAKE_AT);
    if (__atomic_load_n(awake, __ATOMIC_ACQUIRE) < now_ns() + RING_MARGIN_NS) {
        put_buffer(&dir);
        return 0;
    }
    Py_ssize_t at = ring_at(), slots = ring_slots();
    if (get_buffer(page, &view, PyBUF_WRITABLE) < 0) {
        put_buffer(&dir);
        return -1;
    }
    if (view.len < 3 * at) {
        put_buffer(&view);
        put_buffer(&dir);
        PyErr_SetString(PyExc_ValueError, "a session page shorter than its request ring");
        return -1;
    }
    unsigned char *ring = (unsigned char *)view.buf + at;
    uint64_t *head_word = (uint64_t *)ring, *tail_word = (uint64_t *)(ring + 64);
    uint64_t head = __atomic_load_n(head_word, __ATOMIC_RELAXED);   /* (the client's own word) */
    int put = 0;
    if (head - __atomic_load_n(tail_word, __ATOMIC_ACQUIRE) < (uint64_t)slots) {
        unsigned char *slot = ring + RING_SLOTS_AT + (Py_ssize_t)(head % (uint64_t)slots) * RING_SLOT;
        uint32_t n = (uint32_t)(flen + name_len);
        uint16_t nl = (uint16_t)name_len;
        uint64_t id = rid;
        memcpy(slot, &n, 4);
        memcpy(slot + 4, frame, flen);
        memcpy(slot + 4 + name_len_at, &nl, 2);
        memcpy(slot + 4 + ID_AT, &id, 8);
        memcpy(slot + 4 + flen, name, name_len);
        __atomic_store_n(head_word, head + 1, __ATOMIC_RELEASE);   /* the frame is whole before it counts */
        put = __atomic_load_n(awake, __ATOMIC_ACQUIRE) < now_ns() + RING_MARGIN_NS ? 2 : 1;
    }
    put_buffer(&view);
    put_buffer(&dir);
    return put;
}

/* The ring's frame arguments, ``args[0..5]`` as ``ring_put`` takes them (page, directory, frame,
 * name_len_at, rid, name), written by ``ring_write``. */
static int ring_write_args(PyObject *const *args) {
    const char *frame;
    Py_ssize_t flen, name_len_at, name_len;
    unsigned long long rid;
    if (!as_y(args[2], &frame, &flen) || !as_n(args[3], &name_len_at) || !as_K(args[4], &rid)
            || !is_a(args[5], &PyUnicode_Type, "a str"))
        return -1;
    const char *name = PyUnicode_AsUTF8AndSize(args[5], &name_len);
    if (name == NULL)
        return -1;
    return ring_write(args[0], args[1], frame, flen, name_len_at, rid, name, name_len);
}

/* ring_put(page, directory, frame, name_len_at, rid, name) -> 0, 1 or 2: ``ring_write``. */
static PyObject *ring_put(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (!args_are(nargs, 6, "ring_put"))
        return NULL;
    int put = ring_write_args(args);
    return put < 0 ? NULL : PyLong_FromLong(put);
}

#define BOARD_WORDS (1 << 16)
#define SLEEPERS_AT (BOARD_WORDS * 8)   /* the seal board's word after its words: a reader may sleep */

/* ``event`` (a CUevent, as an int; 0: none to record, as on host memory) recorded on ``stream`` (a
 * CUstream), then word ``index`` of the seal board ``board`` set to ``seq`` (``Board.post``), after
 * the record as R1 needs. 0: done; -2: done, and a reader may sleep on the board (its deadline, at
 * SLEEPERS_AT, is set); -1: no driver loaded here; a CUresult: the record failed, nothing posted;
 * -3: an error set (a board too short, a word not on it). ``word`` gets the posted word's address. */
static long record_and_post(unsigned long long event, unsigned long long stream, PyObject *board, Py_ssize_t index,
                            unsigned long long seq, uint64_t **word, uint64_t *sleepers) {
    Py_buffer view;
    if (get_buffer(board, &view, PyBUF_WRITABLE) < 0)
        return -3;
    if (view.len < SLEEPERS_AT + 8 || index < 0 || index >= BOARD_WORDS) {
        put_buffer(&view);
        PyErr_SetString(PyExc_IndexError, "no such seal board word");
        return -3;
    }
    long got = 0;
    if (event) {
        event_record_fn record = driver_event_record();
        got = record == NULL ? -1 : record((void *)(uintptr_t)event, (void *)(uintptr_t)stream);
    }
    if (got == 0) {
        uint64_t *words = view.buf;
        __atomic_store_n(words + index, (uint64_t)seq, __ATOMIC_RELEASE);
        *word = words + index;
        *sleepers = __atomic_load_n(words + SLEEPERS_AT / 8, __ATOMIC_ACQUIRE);
        if (*sleepers)
            got = -2;
    }
    put_buffer(&view);   /* (the map outlives the call: its owner closes it only at the pool's close) */
    return got;
}

/* record_post(event, stream, board, index, seq) -> 0, -2, -1 or a CUresult: ``record_and_post``
 * (the caller wakes a sleeper, ``Board.wake``). */
static PyObject *record_post(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long event, stream, seq;
    Py_ssize_t index;
    if (!args_are(nargs, 5, "record_post") || !as_K(args[0], &event) || !as_K(args[1], &stream)
            || !as_n(args[3], &index) || !as_K(args[4], &seq))
        return NULL;
    uint64_t *word, sleepers;
    long got = record_and_post(event, stream, args[2], index, seq, &word, &sleepers);
    return got == -3 ? NULL : PyLong_FromLong(got);
}

/* seal_put(event, stream, board, index, seq, page, directory, frame, name_len_at, rid, name) ->
 * the ring's 0, 1 or 2 (``ring_write``), or < 0 where nothing was done: -1 no driver loaded here,
 * else -1 - a CUresult (the record failed). A steady writer's seal in one call: the record and the
 * board post (``record_and_post``), a reader asleep on the word woken (a futex wake, only while
 * the board's sleepers' deadline has not passed: ``Board.wake``), then its frame built ahead put
 * in the ring (``ring_put``'s arguments). */
static PyObject *seal_put(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long event, stream, seq;
    Py_ssize_t index;
    if (!args_are(nargs, 11, "seal_put") || !as_K(args[0], &event) || !as_K(args[1], &stream)
            || !as_n(args[3], &index) || !as_K(args[4], &seq))
        return NULL;
    uint64_t *word = NULL, sleepers = 0;
    long got = record_and_post(event, stream, args[2], index, seq, &word, &sleepers);
    if (got == -3)
        return NULL;
    if (got == -1 || got > 0)
        return PyLong_FromLong(got == -1 ? -1 : -1 - got);
#ifdef SYS_futex
    if (got == -2 && sleepers > now_ns())   /* shared (no FUTEX_PRIVATE_FLAG): readers of other processes */
        syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
#endif
    int put = ring_write_args(args + 5);
    return put < 0 ? NULL : PyLong_FromLong(put);
}

/* The create frame (``frames``): magic, kind, pool length, name length, meta length, slot, then
 * the id, arena, offset, nbytes and seal number (u64 each, the id at ID_AT) and the credit. */
#define FRAME_MAGIC 0xC1
#define FRAME_CREATE 1
#define CREATE_SIZE 116
#define NO_SLOT 0xFFFFFFFFu
#define MAX_ID (1ull << 63)

static int name_char(unsigned char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_'
           || c == ':' || c == '-';
}

/* A name ``protocol.NAME_RE`` takes: ASCII, a letter or digit first, parts of '._:-' and letters
 * and digits joined by '/', none empty (the last may be, after a final '/'), none after the first
 * '.' or '..'. Whatever this refuses, Python's ``read_create`` reads again (and may still take). */
static int name_valid(const unsigned char *s, Py_ssize_t n) {
    if (n < 1 || n > MAX_NAME || !name_char(s[0]) || s[0] == '.' || s[0] == '_' || s[0] == ':' || s[0] == '-')
        return 0;
    Py_ssize_t part = 0;
    for (Py_ssize_t i = 0; i <= n; i++) {
        if (i < n && s[i] != '/') {
            if (!name_char(s[i]))
                return 0;
            continue;
        }
        Py_ssize_t len = i - part;   /* the part [part, i), ended by '/' or the name's end */
        if (len == 0 && (i < n || part == 0))
            return 0;
        if (part > 0 && s[part] == '.' && (len == 1 || (len == 2 && s[part + 1] == '.')))
            return 0;
        part = i + 1;
    }
    return 1;
}

/* valid_name(name) -> bool: whether ``name`` is a str ``protocol.NAME_RE`` takes (``name_valid``):
 * a writer's create checks its name in this one call, where Python's check is several on a CPU
 * back from sleep. */
static PyObject *valid_name(PyObject *Py_UNUSED(self), PyObject *arg) {
    if (!PyUnicode_Check(arg))
        return bool_of(0);
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(arg, &n);
    if (s == NULL) {   /* (a lone surrogate: no name) */
        PyErr_Clear();
        return bool_of(0);
    }
    return bool_of(name_valid((const unsigned char *)s, n));
}

/* A usual create frame's fields, read in place (``parse_create``). */
struct create_frame {
    uint64_t rid, arena, offset, nbytes, seq;
    uint32_t slot;
    const unsigned char *credit, *pool, *name;
    Py_ssize_t pool_len, name_len;
};

/* Whether ``d`` is the usual create (no metadata, a length that adds up, an id in range, a plain
 * ASCII pool and a valid name), its fields read into ``f``; 0: anything else. */
static int parse_create(const unsigned char *d, Py_ssize_t len, struct create_frame *f) {
    if (len < CREATE_SIZE || d[0] != FRAME_MAGIC || d[1] != FRAME_CREATE)
        return 0;
    f->pool_len = u16(d + 2);
    f->name_len = u16(d + 4);
    f->slot = u32(d + 8);
    f->rid = u64(d + ID_AT);
    f->arena = u64(d + 20);
    f->offset = u64(d + 28);
    f->nbytes = u64(d + 36);
    f->seq = u64(d + 44);
    f->credit = d + 52;
    f->pool = d + CREATE_SIZE;
    f->name = f->pool + f->pool_len;
    if (u16(d + 6) || len != CREATE_SIZE + f->pool_len + f->name_len || f->rid >= MAX_ID || f->pool_len < 1
            || f->pool_len > MAX_NAME || !name_valid(f->name, f->name_len))
        return 0;
    for (Py_ssize_t i = 0; i < f->pool_len; i++)
        if (f->pool[i] >= 0x80)
            return 0;
    return 1;
}

/* ``frames.Create``'s fields of a parsed frame: (id, pool, name, nbytes, None, arena, offset,
 * slot, seq, credit), slot and seq None without a slot, credit None where all zeros. */
static PyObject *create_fields(const struct create_frame *f) {
    int no_slot = f->slot == NO_SLOT;
    PyObject *items[10] = {
        PyLong_FromUnsignedLongLong(f->rid),
        PyUnicode_DecodeASCII((const char *)f->pool, f->pool_len, NULL),
        PyUnicode_DecodeASCII((const char *)f->name, f->name_len, NULL),
        PyLong_FromUnsignedLongLong(f->nbytes),
        Py_NewRef(Py_None),
        PyLong_FromUnsignedLongLong(f->arena),
        PyLong_FromUnsignedLongLong(f->offset),
        no_slot ? Py_NewRef(Py_None) : PyLong_FromUnsignedLong(f->slot),
        no_slot ? Py_NewRef(Py_None) : PyLong_FromUnsignedLongLong(f->seq),
        is_zero(f->credit, 64) ? Py_NewRef(Py_None) : PyBytes_FromStringAndSize((const char *)f->credit, 64),
    };
    PyObject *out = PyTuple_New(10);
    for (int i = 0; i < 10; i++) {   /* (each given to the tuple, which drops them with itself) */
        if (out == NULL || items[i] == NULL) {
            for (int k = i; k < 10; k++)
                Py_XDECREF(items[k]);
            Py_XDECREF(out);
            return NULL;
        }
        PyTuple_SetItem(out, i, items[i]);
    }
    return out;
}

/* read_create(data) -> ``create_fields``, or None where the frame is not the usual create:
 * ``frames.read_create`` reads those in Python, and refuses what it must. The broker's first step
 * with a create, on the way to the entry a reader waits for. */
static PyObject *read_create(PyObject *Py_UNUSED(self), PyObject *arg) {
    Py_buffer view;
    if (get_buffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    struct create_frame f;
    PyObject *out = parse_create(view.buf, view.len, &f) ? create_fields(&f) : Py_NewRef(Py_None);
    put_buffer(&view);
    return out;
}

/* usual_create's ticket (``broker.arenas.Ticket``): what an arena's usual creates are checked
 * against, by index. */
enum { T_ARENA, T_SESSION, T_POOL, T_WORDS, T_FIRST_SEQ, T_STARTS, T_SIZES, T_CAPACITY, T_ALIGN, T_MAP,
       T_DIR_CAPACITY, T_PROBES, T_PROMISES, T_LIMIT, T_UID, T_FIELDS };
#define BOARD_BLOCK 256              /* sealboard.BLOCK: words per arena */
#define FIRST_MAX (1ull << 62)       /* sealboard.FIRST_MAX */

static PyObject *str_closed;   /* "closed", interned */

/* A ticket's int field; -1 (the error cleared) where it is not one in [0, 2**63). */
static long long ticket_int(PyObject *ticket, int k) {
    long long v = PyLong_AsLongLong(PyTuple_GetItem(ticket, k));
    if (v < 0) {
        PyErr_Clear();
        return -1;
    }
    return v;
}

/* usual_create(frame, session, tickets, objects, counts, gen) -> (fields, size, index), or None.
 * The usual carved create, checked as the broker's Python would check it (``Handlers.create``,
 * ``ObjectTable.create``), its range taken in the arena's mirror and its directory entry written,
 * in one call: the work between a create's receipt and the entry a reader waits for. ``tickets``:
 * arena id -> its ticket; ``objects``: the live names; ``counts``: uid -> its named objects; ``gen``
 * the entry's number. ``fields``: ``create_fields``; ``size``: the range as taken (rounded);
 * ``index``: the entry's, None where the probe found no free entry. None, with nothing changed:
 * anything not usual or not allowed (another frame, an arena without a ticket, a word, number,
 * credit, name, quota or range the Python refuses or might): the caller does it the Python way,
 * which refuses what it must, saying why. */
static PyObject *usual_create(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    PyObject *frame, *session, *tickets, *objects, *counts;
    unsigned long long gen;
    if (!args_are(nargs, 6, "usual_create") || !is_a(args[2], &PyDict_Type, "a dict")
            || !is_a(args[3], &PyDict_Type, "a dict") || !is_a(args[4], &PyDict_Type, "a dict") || !as_K(args[5], &gen))
        return NULL;
    frame = args[0], session = args[1], tickets = args[2], objects = args[3], counts = args[4];
    Py_buffer fv;
    if (get_buffer(frame, &fv, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out = NULL, *aid = NULL, *name = NULL, *credit = NULL, *start = NULL, *size_obj = NULL, *fields = NULL;
    Py_buffer mv = {0};
    struct create_frame f;
    if (!parse_create(fv.buf, fv.len, &f) || f.slot == NO_SLOT || f.slot >= BOARD_BLOCK || f.seq < 1
            || f.seq >= FIRST_MAX || f.arena >= MAX_ID || f.offset >= MAX_ID || f.nbytes >= MAX_ID)
        goto not_usual;
    aid = PyLong_FromUnsignedLongLong(f.arena);
    if (aid == NULL)
        goto failed;
    PyObject *ticket = PyDict_GetItem(tickets, aid);   /* (borrowed) */
    if (ticket == NULL || !PyTuple_Check(ticket) || PyTuple_Size(ticket) != T_FIELDS
            || PyTuple_GetItem(ticket, T_SESSION) != session)
        goto not_usual;
    PyObject *closed = PyObject_GetAttr(PyTuple_GetItem(ticket, T_ARENA), str_closed);
    if (closed == NULL)
        goto failed;
    Py_DECREF(closed);
    if (closed != Py_False)
        goto not_usual;
    Py_ssize_t pool_len;
    const char *pool = PyUnicode_AsUTF8AndSize(PyTuple_GetItem(ticket, T_POOL), &pool_len);
    if (pool == NULL)
        goto failed;
    long long words = ticket_int(ticket, T_WORDS), first_seq = ticket_int(ticket, T_FIRST_SEQ),
              capacity = ticket_int(ticket, T_CAPACITY), align = ticket_int(ticket, T_ALIGN),
              dir_capacity = ticket_int(ticket, T_DIR_CAPACITY), probes = ticket_int(ticket, T_PROBES),
              limit = ticket_int(ticket, T_LIMIT);
    if (pool_len != f.pool_len || memcmp(pool, f.pool, pool_len) || words < 0 || first_seq < 0 || capacity < 0
            || align <= 0 || dir_capacity <= 0 || probes < 0 || limit < 0 || f.seq < (uint64_t)first_seq
            || words + f.slot > 0xFFFFFFFEll)
        goto not_usual;
    /* The credit its seal will be recorded on: one of the session's (``promises``), or none where
     * its pool has no events (None). */
    PyObject *promises = PyTuple_GetItem(ticket, T_PROMISES);
    int no_credit = is_zero(f.credit, 64);
    if (promises == Py_None) {
        if (!no_credit)
            goto not_usual;
    } else {
        if (no_credit || !PyDict_Check(promises))
            goto not_usual;
        credit = PyBytes_FromStringAndSize((const char *)f.credit, 64);
        if (credit == NULL)
            goto failed;
        int has = PyDict_Contains(promises, credit);
        if (has < 0)
            goto failed;
        if (!has)
            goto not_usual;
    }
    /* Its name, free; its uid below its objects quota. */
    name = PyUnicode_DecodeASCII((const char *)f.name, f.name_len, NULL);
    if (name == NULL)
        goto failed;
    int taken = PyDict_Contains(objects, name);
    if (taken < 0)
        goto failed;
    if (taken)
        goto not_usual;
    if (limit) {
        PyObject *count = PyDict_GetItem(counts, PyTuple_GetItem(ticket, T_UID));
        if (count != NULL) {
            long long n = PyLong_AsLongLong(count);
            if (n < 0 || n >= limit) {
                PyErr_Clear();
                goto not_usual;
            }
        }
    }
    /* Its range: aligned, inside the arena, overlapping no range taken (``TakenRanges.reserve``). */
    uint64_t a = (uint64_t)align, size = f.nbytes ? (f.nbytes + a - 1) / a * a : a;
    if (f.offset % a || f.nbytes > (uint64_t)capacity || f.offset + size > (uint64_t)capacity)
        goto not_usual;
    PyObject *starts = PyTuple_GetItem(ticket, T_STARTS), *sizes = PyTuple_GetItem(ticket, T_SIZES);
    if (!PyList_Check(starts) || !PyDict_Check(sizes))
        goto not_usual;
    Py_ssize_t lo = 0, hi = PyList_Size(starts);
    Py_ssize_t n = hi;
    while (lo < hi) {   /* bisect_right: the first start past the offset */
        Py_ssize_t mid = (lo + hi) / 2;
        long long v = PyLong_AsLongLong(PyList_GetItem(starts, mid));
        if (v < 0)
            goto failed_cleared;
        if (f.offset < (uint64_t)v)
            hi = mid;
        else
            lo = mid + 1;
    }
    if (lo > 0) {
        PyObject *prev = PyList_GetItem(starts, lo - 1), *prev_size = PyDict_GetItem(sizes, prev);
        long long p = PyLong_AsLongLong(prev), ps = prev_size == NULL ? -1 : PyLong_AsLongLong(prev_size);
        if (p < 0 || ps < 0)
            goto failed_cleared;
        if ((uint64_t)(p + ps) > f.offset)
            goto not_usual;
    }
    if (lo < n) {
        long long next = PyLong_AsLongLong(PyList_GetItem(starts, lo));
        if (next < 0)
            goto failed_cleared;
        if ((uint64_t)next < f.offset + size)
            goto not_usual;
    }
    /* Every check passed: what can fail made first, then the range taken and the entry written. */
    fields = create_fields(&f);
    if (fields == NULL || map_of(PyTuple_GetItem(ticket, T_MAP), dir_capacity, PyBUF_WRITABLE, &mv) < 0)
        goto failed;
    start = PyLong_FromUnsignedLongLong(f.offset);
    size_obj = PyLong_FromUnsignedLongLong(size);
    if (start == NULL || size_obj == NULL || PyList_Insert(starts, lo, start) < 0)
        goto failed;
    if (PyDict_SetItem(sizes, start, size_obj) < 0) {
        PySequence_DelItem(starts, lo);
        goto failed;
    }
    Py_ssize_t index = publish_into(mv.buf, dir_capacity, probes, f.name, f.name_len, gen, WRITING, f.arena, f.offset,
                                    f.nbytes, (uint32_t)(words + f.slot), f.seq, f.credit, no_credit ? 0 : 64,
                                    NULL, 0, NULL, 0, 0, IN_ARENA | (no_credit ? 0 : KEPT_EVENT));
    PyObject *items[3] = {Py_NewRef(fields), Py_NewRef(size_obj), index < 0 ? Py_NewRef(Py_None) : PyLong_FromSsize_t(index)};
    out = tuple_of(3, items);
    goto done;   /* (a tuple that could not be made: the range and entry stay, as a full memory
                    the broker's loop reports; nothing else fails past the checks) */
failed_cleared:
    PyErr_Clear();
not_usual:
    out = Py_NewRef(Py_None);
    goto done;
failed:
    out = NULL;
done:
    if (mv.obj != NULL)
        put_buffer(&mv);
    put_buffer(&fv);
    Py_XDECREF(aid);
    Py_XDECREF(name);
    Py_XDECREF(credit);
    Py_XDECREF(start);
    Py_XDECREF(size_obj);
    Py_XDECREF(fields);
    return out;
}

static PyObject *crc32_py(PyObject *Py_UNUSED(self), PyObject *arg) {   /* for the tests: zlib.crc32's */
    const char *p;
    Py_ssize_t n;
    if (!PyArg_Parse(arg, "y#", &p, &n))
        return NULL;
    return PyLong_FromUnsignedLong(crc32_of((const unsigned char *)p, n));
}

static PyMethodDef methods[] = {
    {"lookup", (PyCFunction)(void (*)(void))lookup, METH_FASTCALL, "lookup(map, capacity, probes, name, torn_us): an entry's fields, or None"},
    {"take", (PyCFunction)(void (*)(void))take, METH_FASTCALL, "take(page, free, nonces, torn_us, map, capacity, probes, name, pool, arenas, sealed_only[, made, credits]): (fields, slot, nonce, state), (None, slot, nonce, index, gen, made's) or None"},
    {"state", (PyCFunction)(void (*)(void))state, METH_FASTCALL, "state(map, index, gen): the entry's state while it holds gen, else GONE; None: being written still"},
    {"publish", publish, METH_VARARGS, "publish(map, capacity, probes, name, gen, state, alloc, offset, size, word, seq, event, dtype, dims, ndim, flags): the index written, or None"},
    {"ring_put", (PyCFunction)(void (*)(void))ring_put, METH_FASTCALL, "ring_put(page, directory, frame, name_len_at, rid, name): 1 put, 2 put (nudge), 0 not put"},
    {"event_query", event_query, METH_O, "event_query(event): cuEventQuery's CUresult, -1 without a driver"},
    {"record_post", (PyCFunction)(void (*)(void))record_post, METH_FASTCALL, "record_post(event, stream, board, index, seq): 0 (-2: wake sleepers), -1 no driver, else a CUresult"},
    {"seal_put", (PyCFunction)(void (*)(void))seal_put, METH_FASTCALL, "seal_put(event, stream, board, index, seq, page, directory, frame, name_len_at, rid, name): the ring's 0, 1 or 2 once recorded and posted; -1 no driver, else -1 - the record's CUresult (nothing done)"},
    {"valid_name", valid_name, METH_O, "valid_name(name): whether name is a valid object name (protocol.NAME_RE)"},
    {"read_create", read_create, METH_O, "read_create(frame): a usual create frame's fields (frames.Create's), or None"},
    {"usual_create", (PyCFunction)(void (*)(void))usual_create, METH_FASTCALL, "usual_create(frame, session, tickets, objects, counts, gen): (fields, size, index) of a usual create checked, its range taken and its entry written; None: not usual"},
    {"crc32", crc32_py, METH_O, "crc32(data): as zlib.crc32"},
    {"credit_row", (PyCFunction)(void (*)(void))credit_row, METH_FASTCALL, "credit_row(handle, rows): a credit's row in the credit table"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) {
    crc_init();
    str_closed = PyUnicode_InternFromString("closed");
    if (str_closed == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)   /* the constants the tests hold to the Python layouts' */
        return NULL;
    pinned_type = PyType_FromSpec(&pinned_spec);
    if (pinned_type == NULL || PyModule_AddObjectRef(m, "Pinned", pinned_type) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "RING_SLOT", RING_SLOT) < 0 || PyModule_AddIntConstant(m, "RING_SLOTS_AT", RING_SLOTS_AT) < 0
            || PyModule_AddIntConstant(m, "RING_MARGIN_NS", RING_MARGIN_NS) < 0
            || PyModule_AddIntConstant(m, "AWAKE_AT", AWAKE_AT) < 0 || PyModule_AddIntConstant(m, "ID_AT", ID_AT) < 0
            || PyModule_AddIntConstant(m, "CREATE_SIZE", CREATE_SIZE) < 0
            || PyModule_AddIntConstant(m, "BOARD_BLOCK", BOARD_BLOCK) < 0
            || PyModule_AddIntConstant(m, "LEASE_SLOTS", LEASE_SLOTS) < 0
            || PyModule_AddIntConstant(m, "LEASE_SLOT", LEASE_SLOT) < 0
            || PyModule_AddIntConstant(m, "LEASE_HEAD", LEASE_HEAD) < 0
            || PyModule_AddIntConstant(m, "CREDIT_ROW", CREDIT_ROW) < 0
            || PyModule_AddObject(m, "FIRST_MAX", PyLong_FromUnsignedLongLong(FIRST_MAX)) < 0
            || PyModule_AddIntConstant(m, "BOARD_WORDS", BOARD_WORDS) < 0
            || PyModule_AddIntConstant(m, "SLEEPERS_AT", SLEEPERS_AT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
