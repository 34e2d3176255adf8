// The pool-hit and random-page programs of the twenty-seventh run (docs/notebook).
// Build: gcc -O2 -o hit pool-hits.c
// Run:   hit MIB SECONDS [HOT_MIB]
// Fills MIB of memory, each page half random and half zero (about 2:1 under LZ4), or wholly
// random with RANDOM_PAGES=1 in the environment; then for SECONDS reads 8 bytes of random
// pages (with HOT_MIB, 90% of the reads fall in its first HOT_MIB) and prints the accesses per
// second and the latency of those slower than 2 us, as the program sees them.
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>
#include <string.h>
static inline uint64_t now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1000000000ull+t.tv_nsec;}
static uint64_t rng=88172645463325252ull;
static inline uint64_t xr(void){rng^=rng<<13;rng^=rng>>7;rng^=rng<<17;return rng;}
int cmp(const void*a,const void*b){uint64_t x=*(uint64_t*)a,y=*(uint64_t*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){
  size_t mib=atoi(argv[1]); double secs=atof(argv[2]); size_t hot_mib = argc>3?atoi(argv[3]):0;
  size_t pages=mib*256; char*b=malloc(mib<<20);
  for(size_t p=0;p<pages;p++){uint64_t*w=(uint64_t*)(b+p*4096);for(int k=0;k<256;k++)w[k]=xr();if(!getenv("RANDOM_PAGES"))memset(w+256,0,2048);else for(int k=256;k<512;k++)w[k]=xr();}
  size_t hot=hot_mib*256;
  uint64_t *lat=malloc(sizeof(uint64_t)*20000000); size_t n=0,slow=0; uint64_t sum=0;
  uint64_t t0=now(), end=t0+(uint64_t)(secs*1e9); size_t acc=0; volatile uint64_t sink=0;
  while(1){
    for(int i=0;i<1000;i++){
      size_t p = (hot && (xr()%10)<9) ? xr()%hot : xr()%pages;
      uint64_t a=now(); sink+=*(volatile uint64_t*)(b+p*4096+(xr()%256)*8); uint64_t d=now()-a;
      acc++; if(d>2000){ if(n<20000000) lat[n++]=d; slow++; sum+=d; }
    }
    if(now()>end)break;
  }
  double el=(now()-t0)/1e9;
  qsort(lat,n,8,cmp);
  printf("accesses/s %.0f  slow %.2f%%  slow p50 %.1f us p90 %.1f p99 %.1f mean %.1f  (%zu slow)\n",acc/el,100.0*slow/acc,
    n?lat[n/2]/1e3:0,n?lat[n*9/10]/1e3:0,n?lat[n*99/100]/1e3:0,n?sum/1e3/n:0,n);
  return 0;
}
